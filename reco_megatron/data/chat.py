"""Turn a dataset prompt into the text the policy sees.

With a tokenizer that has a chat template (Hugging Face ``apply_chat_template``), the prompt
becomes one user message (after an optional system message) with the assistant turn opened.
Otherwise a plain template string with exactly one ``{prompt}`` placeholder is filled by
string replacement (so braces inside the prompt or the template are never interpreted).
"""

from __future__ import annotations

from dataclasses import dataclass

from reco_megatron.data.tokenizer import chat_template_of

DEFAULT_TEMPLATE = "{prompt}"


@dataclass(kw_only=True)
class PromptFormatter:
    """Formats prompts; ``format(prompt) -> str``."""

    tokenizer: object | None = None
    """A tokenizer; its chat template is used when it has one."""
    template: str = DEFAULT_TEMPLATE
    """Plain fallback with one ``{prompt}``, e.g. ``"Question: {prompt}\\nAnswer:"``."""
    system: str | None = None
    """Optional system message (chat-template path only; put it in ``template`` otherwise)."""

    def __post_init__(self) -> None:
        if self.template.count("{prompt}") != 1:
            raise ValueError(
                f"prompt template {self.template!r} must contain '{{prompt}}' exactly once, "
                "e.g. 'Question: {prompt}\\nAnswer:'"
            )

    @property
    def uses_chat_template(self) -> bool:
        return chat_template_of(self.tokenizer) is not None

    def format(self, prompt: str) -> str:
        """The full prompt text for ``prompt``."""
        apply = chat_template_of(self.tokenizer)
        if apply is not None:
            messages = [{"role": "system", "content": self.system}] if self.system else []
            messages.append({"role": "user", "content": prompt})
            return apply(messages)
        return self.template.replace("{prompt}", prompt)
