import subprocess
import sys


def test_import_agl_core_stays_light():
    code = (
        "import sys, agl_core, agl_core.store, agl_core.gateway, agl_core.pipeline.transitions\n"
        "import agl_core.pipeline.credit, agl_core.runner, agl_core.pipeline.spantree\n"
        "import agl_langchain, agl_openai_agents, agl_autogen, agl_trainer\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'langchain_openai', 'agents', 'autogen_core',"
        " 'autogen_agentchat', 'langgraph') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip() == "[]"


def test_gpu_backends_stay_optional():
    """The serving, verl and requirements modules load without torch, vllm, verl or ray."""
    code = (
        "import sys, agl_trainer.run.serving, agl_trainer.learning.verl_backend, agl_trainer.requirements\n"
        "print([m for m in ('torch', 'vllm', 'verl', 'ray', 'omegaconf', 'peft') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip() == "[]"
