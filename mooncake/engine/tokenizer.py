"""A byte-level BPE tokenizer rebuilt from a GGUF vocabulary and merges (the `tokenizers`
library), with the model's special tokens and chat template (rendered by a sandboxed jinja2).

GGUF's `tokenizer.ggml.add_bos_token` is not applied: for ChatML models such as SmolLM2 the
"BOS" is `<|im_start|>`, which the chat template already writes (the reference Hugging Face
tokenizer adds nothing either).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from mooncake.engine.errors import EngineError

CONTROL, USER_DEFINED = 3, 4  # GGUF token types that are special tokens
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """GGUF `tokenizer.ggml.pre` -> the matching split rules. SmolLM2 ("smollm") splits
    every digit, then applies GPT-2's regex; anything else gets GPT-2's regex."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


class ChatTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_id: int,
        template: str | None,
        special_tokens: Mapping[str, int],
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.special_tokens = dict(special_tokens)
        env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        self._template = env.from_string(template or CHATML)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a turn: EOS and, for ChatML models, `<|im_end|>`."""
        ids = {self.eos_id}
        if "<|im_end|>" in self.special_tokens:
            ids.add(self.special_tokens["<|im_end|>"])
        return frozenset(ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        try:
            return str(
                self._template.render(
                    messages=list(messages), add_generation_prompt=add_generation_prompt
                )
            )
        except Exception as e:  # a template error is a bad-model or bad-message problem
            raise EngineError(f"chat template failed: {e}") from e

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _field(fields: Mapping[str, Any], key: str) -> Any:
    if key not in fields:
        raise EngineError(f"GGUF has no {key}")
    return fields[key].contents()


def tokenizer_from_gguf(fields: Mapping[str, Any]) -> ChatTokenizer:
    """Build the tokenizer from a GGUFReader's `fields`."""
    kind = _field(fields, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise EngineError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, not {kind}")
    tokens: list[str] = list(_field(fields, "tokenizer.ggml.tokens"))
    types: list[int] = list(_field(fields, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(fields, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in fields else "gpt2"
    tok.pre_tokenizer = _pre_tokenizer(str(pre))
    tok.decoder = decoders.ByteLevel()
    specials = {
        t: i
        for i, (t, ty) in enumerate(zip(tokens, types, strict=False))
        if ty in (CONTROL, USER_DEFINED)
    }
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    template = (
        fields["tokenizer.chat_template"].contents()
        if "tokenizer.chat_template" in fields
        else None
    )
    eos = int(_field(fields, "tokenizer.ggml.eos_token_id"))
    return ChatTokenizer(tok, eos_id=eos, template=template, special_tokens=specials)
