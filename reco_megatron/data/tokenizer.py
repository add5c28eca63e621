"""A small tokenizer protocol and its Hugging Face and SentencePiece implementations.

Both backends are imported lazily, inside the constructor: ``transformers`` is optional
(not installed in CI) and ``sentencepiece`` is only needed when a ``.model`` file is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from reco_megatron.utils.paths import file_problem

Message = dict[str, str]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data and rollout code need from a tokenizer.

    ``encode(text) -> list[int]`` (no BOS/EOS added), ``decode(ids) -> str``, and the ids
    ``eos_id`` / ``pad_id`` (``pad_id`` falls back to ``eos_id`` when the model has none),
    ``vocab_size``. Chat support is optional: see :func:`chat_template_of`.
    """

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """Wraps a ``transformers`` tokenizer (an instance, or a local path loaded offline)."""

    def __init__(self, tokenizer: Any, **from_pretrained_kwargs: Any) -> None:
        if isinstance(tokenizer, str | Path):
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:
                raise ImportError(
                    f"HFTokenizer({str(tokenizer)!r}) needs the 'transformers' package: "
                    "pip install transformers (or pass a SentencePiece .model file instead)"
                ) from exc
            from_pretrained_kwargs.setdefault("local_files_only", True)
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), **from_pretrained_kwargs)
        self.hf = tokenizer
        if self.hf.eos_token_id is None:
            raise ValueError(
                f"tokenizer {getattr(self.hf, 'name_or_path', self.hf)!r} has no eos_token_id; "
                "set tokenizer.eos_token before wrapping it"
            )

    @property
    def eos_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.hf.pad_token_id
        return int(pad) if pad is not None else self.eos_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages: list[Message]) -> str:
        """The prompt text for ``messages`` with the assistant turn opened."""
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file (e.g. ``examples/tiny/countdown_sp.model``)."""

    def __init__(self, model_file: str | Path) -> None:
        import sentencepiece as spm

        path = Path(model_file)
        kind = file_problem(path)
        if kind == "does not exist":
            raise FileNotFoundError(
                f"SentencePiece model {str(path)!r} not found; train one with "
                "examples/tiny/train_tokenizer.py or pass the right path"
            )
        if kind is not None:
            raise ValueError(f"SentencePiece model {str(path)!r} {kind}")
        try:  # sentencepiece raises RuntimeError (garbage) or OSError; never a traceback
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as exc:
            reason = " ".join(str(exc).replace(str(path), "it").split())[:200]
            raise ValueError(
                f"SentencePiece model {str(path)!r} is not a valid model file "
                f"({type(exc).__name__}: {reason}); pass the .model file sentencepiece wrote"
            ) from exc
        if self.sp.eos_id() < 0:
            raise ValueError(f"SentencePiece model {str(path)!r} defines no EOS piece (eos_id=-1)")
        self.has_chat_template = False

    @property
    def eos_id(self) -> int:
        return int(self.sp.eos_id())

    @property
    def pad_id(self) -> int:
        pad = self.sp.pad_id()
        return int(pad) if pad >= 0 else self.eos_id

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))


def chat_template_of(tokenizer: object) -> Any | None:
    """``tokenizer.apply_chat_template`` when the tokenizer has a usable chat template."""
    apply = getattr(tokenizer, "apply_chat_template", None)
    if callable(apply) and getattr(tokenizer, "has_chat_template", False):
        return apply
    return None
