"""A chat template: how a conversation becomes one prompt, stated in the model's config.

A generative model that chat completions may use (``POST /v1/chat/completions``) names its
template in ``config.pbtxt``:

- ``chat_template``: the text of one message, with ``{role}`` and ``{content}`` in it; the
  messages' texts are joined in order;
- ``chat_generation_prompt``: appended after the last message, to open the reply (optional).

Placeholders are replaced literally (never ``str.format``: a message may hold braces). The demo
LM's (``model_server.demo_lm``)::

    parameters { key: "chat_template" value { string_value: "<|{role}|>\\n{content}\\n" } }
    parameters { key: "chat_generation_prompt" value { string_value: "<|assistant|>\\n" } }

so ``[{"role": "user", "content": "hi"}]`` is the prompt ``<|user|>\\nhi\\n<|assistant|>\\n``.
The vocabulary is byte level: each byte of it is a token, after the model's BOS token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2

TEMPLATE_PARAMETER = "chat_template"
GENERATION_PROMPT_PARAMETER = "chat_generation_prompt"
ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    message: str  # with {role} and {content}
    generation_prompt: str = ""

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        """The prompt for ``messages`` ((role, content) pairs), then the generation prompt."""
        parts = [
            self.message.replace("{role}", role).replace("{content}", content)
            for role, content in messages
        ]
        return "".join(parts) + self.generation_prompt


def chat_template(config: model_config_pb2.ModelConfig) -> ChatTemplate | None:
    """The template a model's config states, None when it states none."""
    parameters = config.parameters
    if TEMPLATE_PARAMETER not in parameters:
        return None
    message = parameters[TEMPLATE_PARAMETER].string_value
    if "{content}" not in message:
        return None  # a template that drops every message is no template
    prompt = parameters[GENERATION_PROMPT_PARAMETER].string_value if (
        GENERATION_PROMPT_PARAMETER in parameters
    ) else ""  # fmt: skip
    return ChatTemplate(message, prompt)
