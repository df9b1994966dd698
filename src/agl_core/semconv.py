"""Every span attribute key and span name agl writes or reads.

Code never spells an attribute key as a literal: it imports the constant from here. Keys from the
OpenTelemetry GenAI semantic conventions (``gen_ai.*``) are used where one exists; RL-only fields get an
``agl.*`` name. OpenInference keys are listed so traces from its instrumentors can be read as well.
"""

from __future__ import annotations

# --- agl: rollout identity -------------------------------------------------------------------------
ROLLOUT_ID = "agl.rollout.id"
ATTEMPT_ID = "agl.attempt.id"
TASK_ID = "agl.task.id"
#: Which component produced a span: one of the ``SOURCE_*`` values below.
SOURCE = "agl.source"
SOURCE_GATEWAY = "gateway"
SOURCE_RUNNER = "runner"
SOURCE_LANGCHAIN = "langchain"
SOURCE_OPENAI_AGENTS = "openai_agents"
SOURCE_AUTOGEN = "autogen"
SOURCE_USER = "user"
#: Not written on spans: how agl names spans made by an OpenInference instrumentor (they carry
#: ``openinference.span.kind`` and no ``agl.source``) when it groups LLM calls by the component that
#: described them.
SOURCE_OPENINFERENCE = "openinference"

# --- agl: rewards ----------------------------------------------------------------------------------
REWARD_VALUE = "agl.reward.value"
#: Optional label of a reward (``"episode"`` by default); lets one rollout carry several named rewards.
REWARD_NAME = "agl.reward.name"
#: Who gave a reward attached after the fact (``agl reward --source``, ``POST /api/rewards``): a free label
#: such as ``"user"``, ``"tests"`` or ``"grader"``; absent on rewards emitted during the rollout.
REWARD_SOURCE = "agl.reward.source"
#: The caller's id of a reward attached after the fact; the store keeps one reward per id.
REWARD_ID = "agl.reward.id"

# --- agl: exact tokens recorded by the gateway -----------------------------------------------------
PROMPT_TOKEN_IDS = "agl.llm.prompt_token_ids"
RESPONSE_TOKEN_IDS = "agl.llm.response_token_ids"
#: Log-probability of each sampled response token under the serving policy (raw logits, temperature 1).
RESPONSE_LOGPROBS = "agl.llm.response_logprobs"
POLICY_VERSION = "agl.policy.version"
#: The policy (a LoRA adapter of the base model, config ``policies``) that served an LLM call, or ``base``
#: when the call's agent is served by the untrained base model. Absent when one policy serves every agent.
POLICY_NAME = "agl.policy.name"
#: The ``agl improve`` service whose version the gateway served (the service that claimed the gateway by
#: publishing to it); absent when no service published to it. Versions are numbered per service.
POLICY_OWNER = "agl.policy.owner"
#: The version of the prompt policy (system instruction and demonstrations, ``/agl/v1/prompt``) the
#: gateway applied to a call's messages before rendering them; absent when none applied.
PROMPT_VERSION = "agl.prompt.version"
#: The agent that prompt policy was published for, or ``*`` for the one every other agent gets.
PROMPT_SCOPE = "agl.prompt.scope"
#: False when the serving backend cannot be trained (an external endpoint used for evaluation).
TRAINABLE = "agl.llm.trainable"
#: Which of the ``n`` choices of one request a gateway span records (one span per choice).
CHOICE_INDEX = "agl.llm.choice_index"
#: True when the client asked for a streamed (server-sent events) response.
STREAM = "agl.llm.stream"
#: Leading response tokens the backend forced (a named or "required" ``tool_choice``) instead of sampling.
RESPONSE_FORCED_TOKENS = "agl.llm.response_forced_tokens"
#: Seconds from the request's arrival to the first generated text or token reaching the gateway.
TIME_TO_FIRST_TOKEN = "agl.llm.time_to_first_token"
#: Drift check: True when the prompt ids the backend reports differ from the gateway's own rendering of
#: the chat template, False when they match; absent when the call was not checked.
PROMPT_DRIFT = "agl.llm.prompt_drift"
#: The gateway's own rendering of the prompt, recorded only when it differs from the backend's.
RENDERED_PROMPT_TOKEN_IDS = "agl.llm.rendered_prompt_token_ids"
#: Kind of backend that served a gateway call: ``"hf"``, ``"vllm"`` or ``"openai"``.
GATEWAY_BACKEND = "agl.gateway.backend"
#: The wire protocol of a gateway call: ``"chat"`` (Chat Completions), ``"completions"``, ``"responses"``
#: (the OpenAI Responses API) or ``"messages"`` (Anthropic Messages).
GATEWAY_PROTOCOL = "agl.gateway.protocol"
#: Tool-call check of a call whose request offered tools: True when the response tried to call a tool and
#: at least one call is malformed (see the reasons below), False when every call was well formed; absent
#: when the request offered no tools.
TOOL_CALL_MALFORMED = "agl.llm.tool_call_malformed"
#: One reason per malformed tool call: ``TOOL_CALL_UNPARSEABLE``, ``TOOL_CALL_UNKNOWN_TOOL`` or
#: ``TOOL_CALL_INVALID_ARGUMENTS``.
TOOL_CALL_MALFORMED_REASONS = "agl.llm.tool_call_malformed_reasons"
#: Call ids of the malformed calls the client still received (unknown tool, invalid arguments).
TOOL_CALL_MALFORMED_IDS = "agl.llm.tool_call_malformed_ids"
#: The model opened a tool call (its format's opening marker is in the text) that could not be parsed;
#: the client got the raw text as content.
TOOL_CALL_UNPARSEABLE = "unparseable"
#: A tool call names a function the request did not offer.
TOOL_CALL_UNKNOWN_TOOL = "unknown_tool"
#: A tool call's arguments are not a JSON object.
TOOL_CALL_INVALID_ARGUMENTS = "invalid_arguments"

# --- OpenTelemetry GenAI conventions ---------------------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_AGENT_ID = "gen_ai.agent.id"
GEN_AI_AGENT_DESCRIPTION = "gen_ai.agent.description"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
#: Identifies the conversation (thread, session) a call belongs to; ``agl import`` makes one rollout of the
#: traces that share it.
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
#: JSON-encoded arguments of a tool call (opt-in content in the GenAI conventions); agl writes it only on
#: the tool spans of ``agl_core.tool_call(..., arguments=...)``.
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
#: JSON-encoded input / output messages (opt-in content capture in the GenAI conventions).
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
#: JSON-encoded tool definitions offered to the model.
GEN_AI_TOOL_DEFINITIONS = "gen_ai.tool.definitions"
#: The UTF-8 size of a call's input messages / tool definitions when the gateway recorded them cut short
#: (``--max-recorded-prompt-bytes``); absent when recorded whole.
INPUT_MESSAGES_ORIGINAL_BYTES = "agl.gen_ai.input.messages.original_bytes"
TOOL_DEFINITIONS_ORIGINAL_BYTES = "agl.gen_ai.tool.definitions.original_bytes"
ERROR_TYPE = "error.type"
#: ``error.type`` of a failed tool span when the framework handed the failure to the model as the tool's
#: result without the exception (LangChain's ``handle_tool_error``).
ERROR_TYPE_TOOL_RESULT = "tool_error"

# Values of ``gen_ai.operation.name``.
OP_CHAT = "chat"
OP_TEXT_COMPLETION = "text_completion"
OP_EXECUTE_TOOL = "execute_tool"
OP_INVOKE_AGENT = "invoke_agent"
#: Not a GenAI value: a chain / graph step that is neither an LLM nor a tool call.
OP_STEP = "agl.step"
#: Not a GenAI value: control passing from one agent to another (Agents SDK handoff; an AutoGen swarm
#: handoff is its `transfer_to_*` tool call).
OP_HANDOFF = "agl.handoff"
#: Not a GenAI value: an input / output guardrail check (Agents SDK).
OP_GUARDRAIL = "agl.guardrail"

# --- agl: agent structure the GenAI conventions do not cover ---------------------------------------
HANDOFF_FROM_AGENT = "agl.handoff.from_agent"
HANDOFF_TO_AGENT = "agl.handoff.to_agent"
GUARDRAIL_NAME = "agl.guardrail.name"
GUARDRAIL_TRIGGERED = "agl.guardrail.triggered"

# --- OpenInference (read only) ---------------------------------------------------------------------
OPENINFERENCE_SPAN_KIND = "openinference.span.kind"
OPENINFERENCE_KIND_LLM = "LLM"
OPENINFERENCE_KIND_TOOL = "TOOL"
OPENINFERENCE_KIND_AGENT = "AGENT"
OPENINFERENCE_KIND_CHAIN = "CHAIN"
LLM_MODEL_NAME = "llm.model_name"
LLM_TOKEN_COUNT_PROMPT = "llm.token_count.prompt"
LLM_TOKEN_COUNT_COMPLETION = "llm.token_count.completion"
OI_AGENT_NAME = "agent.name"
OI_GRAPH_NODE_ID = "graph.node.id"
OI_TOOL_NAME = "tool.name"
#: The session a span belongs to (OpenInference; Langfuse reads the same key); ``agl import`` makes one
#: rollout of the traces that share it.
SESSION_ID = "session.id"
#: JSON object of the run's metadata (OpenInference LangChain: carries ``langgraph_node``).
OI_METADATA = "metadata"
#: Prefixes of OpenInference's flattened messages and tools: ``llm.input_messages.0.message.role``,
#: ``llm.output_messages.0.message.content``, ``llm.tools.0.tool.json_schema`` ...
OI_INPUT_MESSAGES = "llm.input_messages"
OI_OUTPUT_MESSAGES = "llm.output_messages"
OI_TOOLS = "llm.tools"

# --- span names ------------------------------------------------------------------------------------
SPAN_ROLLOUT = "agl.rollout"
SPAN_REWARD = "agl.reward"
SPAN_ERROR = "agl.error"
#: ``error.type`` the runner gives the ``agl.error`` span of a rollout that ran past its time limit.
ERROR_TYPE_ROLLOUT_TIMEOUT = "RolloutTimeout"

# --- HTTP ------------------------------------------------------------------------------------------
HEADER_ROLLOUT_ID = "x-agl-rollout-id"
HEADER_ATTEMPT_ID = "x-agl-attempt-id"
#: Names the agent making a gateway call (also: an ``.../agents/{name}/v1`` base URL); the gateway span then
#: carries it as ``gen_ai.agent.name``.
HEADER_AGENT_NAME = "x-agl-agent-name"
#: Names the session a gateway call belongs to when it names no rollout; with ``agl gateway serve
#: --capture`` the call's span carries it as ``session.id`` and joins that session's rollout.
HEADER_SESSION_ID = "x-agl-session-id"
#: W3C trace context: makes the gateway span a child of the framework span that made the call.
HEADER_TRACEPARENT = "traceparent"
