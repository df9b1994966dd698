"""model.chat_template: a Jinja template file that replaces the tokenizer's own, checked when the config
loads, used by the gateway's rendering (so the trained token ids are its) and handed to a vLLM agl
launches."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_core.gateway.render import TemplateRenderer
from agl_trainer.config import ConfigError, config_from_dict

#: Renders tools (as the calculator agent's calls need) and marks every turn, so a prompt shows which
#: template made it.
TEMPLATE = (
    "{% if tools %}<<tools>>{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)


def _config(tmp_path: Path, template: str | None, **model: object):
    data = {
        "output_dir": str(tmp_path / "out"),
        "model": {"source": "tiny", **({"chat_template": template} if template else {}), **model},
    }
    return config_from_dict(data, base_dir=tmp_path, required=())


def test_the_template_is_resolved_next_to_the_config_and_renders_every_prompt(tmp_path):
    from agl_trainer.run.services import load_served_model

    (tmp_path / "tpl.jinja").write_text(TEMPLATE)
    config = _config(tmp_path, "tpl.jinja")
    assert config.model.chat_template == str(tmp_path / "tpl.jinja")
    _, tokenizer = load_served_model(config, echo=lambda _: None)
    assert tokenizer.chat_template == TEMPLATE
    renderer = TemplateRenderer(tokenizer)
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    ids = renderer.render([{"role": "user", "content": "What is 2 + 2?"}], [tool])
    text = tokenizer.decode(ids)
    assert text.startswith("<<tools>>calculator;") and text.endswith("<<user>>What is 2 + 2?\n<<assistant>>")
    # without the key: the tokenizer's own template, as before
    _, plain = load_served_model(_config(tmp_path, None), echo=lambda _: None)
    assert plain.chat_template != TEMPLATE and "<<user>>" not in plain.decode(
        TemplateRenderer(plain).render([{"role": "user", "content": "What is 2 + 2?"}])
    )


def test_a_vllm_agl_launches_gets_the_same_template(tmp_path):
    from agl_trainer.run.serving import vllm_launch_kwargs

    (tmp_path / "tpl.jinja").write_text(TEMPLATE)
    data = {
        "output_dir": str(tmp_path / "out"),
        "model": {"source": "tiny", "chat_template": "tpl.jinja"},
        "serving": {"backend": "vllm", "vllm": {"launch": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}}},
    }
    config = config_from_dict(data, base_dir=tmp_path, required=())
    args = vllm_launch_kwargs(config)["extra_args"]
    assert args[args.index("--chat-template") + 1] == str(tmp_path / "tpl.jinja")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "is not a file"),
        ("", "is empty"),
        ("{% for m in messages %}{{ m.content }", "does not render a conversation"),
        ("{{ raise_exception('no tools here') }}", "no tools here"),
        ("{{ messages[0].nope.deeper }}", "does not render a conversation"),
        ("Hello, world.", "renders the messages' content nowhere"),
        (b"\xff\xfe{{ x }}", "cannot read"),
    ],
)
def test_a_template_that_cannot_work_is_refused_when_the_config_loads(tmp_path, content, message):
    file = tmp_path / "tpl.jinja"
    if isinstance(content, bytes):
        file.write_bytes(content)
    elif content is not None:
        file.write_text(content)
    with pytest.raises(ConfigError, match=f"'model.chat_template'.*{message}"):
        _config(tmp_path, "tpl.jinja")
