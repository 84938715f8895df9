"""The tokenizer and chat template from the same GGUF file, with the ``tokenizers`` library.

Built straight from the file's vocabulary and merges (byte-level BPE, SmolLM's pre-tokenizer:
digits one by one, then GPT-2's byte-level split); loads in about a second, where transformers'
GGUF path takes ~20 s. Tests check its encodings against transformers' tokenizer.
"""

from __future__ import annotations

import os
from typing import Any

import jinja2
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Tokenizer

from pagedkv.models.files import CheckpointError, read_json, read_text

CONTROL = 3  # llama.cpp's token type of special (control) tokens


class Tokenizer:
    def __init__(self, meta: dict[str, Any]) -> None:
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r}: this reads byte-level BPE (gpt2)")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        tok = _Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        types = list(meta.get("tokenizer.ggml.token_type") or [])
        tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == CONTROL])
        self._tok, self._from_dir = tok, False
        self.bos_token: str | None = None  # (the file's chat template renders without one)
        self.eos_token_id: int = int(meta["tokenizer.ggml.eos_token_id"])
        self.bos_token_id: int | None = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_token: str | None = tokens[self.eos_token_id]
        self._template_source, self._sandboxed = meta.get("tokenizer.chat_template") or None, False
        self._template = jinja2.Environment().from_string(self._template_source) if self._template_source else None
        stop = {self.eos_token_id}
        if "<|im_end|>" in tokens:
            stop.add(tokens.index("<|im_end|>"))
        self.stop_token_ids = frozenset(stop)

    @classmethod
    def from_dir(cls, path: str, stop_ids: frozenset[int] = frozenset()) -> Tokenizer:
        """A Hugging Face checkpoint's tokenizer: ``tokenizer.json`` (the ``tokenizers`` library reads it),
        ``tokenizer_config.json``'s ``chat_template`` (or ``chat_template.jinja``), its bos and eos tokens;
        ``stop_ids`` (generation_config's) end a request besides the eos token. Raw text is encoded with
        the tokenizer's special tokens (a bos, where it adds one); text a chat template rendered, which
        holds them already, without."""
        file = os.path.join(path, "tokenizer.json")
        text = read_text(file, "the tokenizer")  # (bounded: the tokenizers library would read any file whole)
        try:
            tok = _Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own errors: one line either way
            raise CheckpointError(f"{file} cannot be read: {' '.join(str(e).split())[:200]}") from None
        conf_file = os.path.join(path, "tokenizer_config.json")
        conf = read_json(conf_file, "the tokenizer's config") if os.path.exists(conf_file) else {}
        self = cls.__new__(cls)
        self._tok, self._from_dir = tok, True

        def token(key: str) -> str | None:
            t = conf.get(key)
            return t.get("content") if isinstance(t, dict) else t if isinstance(t, str) else None

        self.eos_token, self.bos_token = token("eos_token"), token("bos_token")
        eos = None if self.eos_token is None else tok.token_to_id(self.eos_token)
        self.eos_token_id = eos if eos is not None else min(stop_ids, default=-1)
        bos = None if self.bos_token is None else tok.token_to_id(self.bos_token)
        self.bos_token_id = bos
        template = conf.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            template = read_text(jinja_file, "the chat template")
        if isinstance(template, list):  # (named templates: the default one)
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self._template_source, self._sandboxed = (template if isinstance(template, str) else None), True
        self._template = _environment().from_string(template) if isinstance(template, str) else None
        self.stop_token_ids = frozenset(stop_ids) | ({eos} if eos is not None else set())
        return self

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the compiled chat template (made again from its source): a server's process receives
        the tokenizer its engine's process loaded."""
        return {k: v for k, v in self.__dict__.items() if k != "_template"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        source = self._template_source
        env = _environment() if self._sandboxed else jinja2.Environment()
        self._template = env.from_string(source) if source else None

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` holds it (the ``tokenizers`` library's own format)."""
        return str(self._tok.to_str())

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can give (its added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        special = self._from_dir and not (self.bos_token and text.startswith(self.bos_token))
        return list(self._tok.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model file has no chat template")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token,
            bos_token=self.bos_token or "",
        )


def _environment() -> jinja2.Environment:
    """How transformers renders a chat template: a sandbox, blocks trimmed, ``raise_exception`` at hand."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env
