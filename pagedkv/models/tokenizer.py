"""The tokenizer and chat template from the same GGUF file, with the ``tokenizers`` library.

Built straight from the file's vocabulary and merges (byte-level BPE, SmolLM's pre-tokenizer:
digits one by one, then GPT-2's byte-level split); loads in about a second, where transformers'
GGUF path takes ~20 s. Tests check its encodings against transformers' tokenizer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
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

    @property
    def chat_template_source(self) -> str | None:
        """The model's chat template (Jinja text), or None where it has none."""
        return self._template_source

    def as_hf(self) -> Any:
        """This tokenizer as Hugging Face's ``PreTrainedTokenizerFast`` over the same ``tokenizer.json`` (its chat
        template, eos and bos tokens set), where transformers is installed; else itself. What ``LLM.get_tokenizer``
        hands out and what structured outputs hand the grammar library (``shell/structured.py`` asks for it by
        name: the shell imports no model)."""
        try:
            from tokenizers import Tokenizer as Raw
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            return self
        hf = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_object=Raw.from_str(self.to_json()), eos_token=self.eos_token, bos_token=self.bos_token
        )
        hf.chat_template = self.chat_template_source
        return hf

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

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        content_format: str = "auto",
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as the chat template renders it (vLLM's and transformers' keywords): ``messages``'
        content a string or OpenAI's content parts (text parts joined, ``content_format`` auto or string; openai
        passes the parts to the template as they are; a part that is not text is a ``ValueError``);
        ``chat_template``: a template of the caller's instead of the model's; ``continue_final_message``: the text
        ends inside the last message (no end of turn after it, for the model to go on), which excludes
        ``add_generation_prompt``; ``tools`` and ``template_kwargs`` (``enable_thinking``, ...) reach the template.
        A template that does not compile or raises is a ``ValueError``."""
        if content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be auto, string or openai, got {content_format!r:.40}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        turns = [chat_turn(m, keep_parts=content_format == "openai") for m in messages]
        template = self._template
        if chat_template is not None:
            try:
                template = _environment().from_string(chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"the chat template does not compile: {' '.join(str(e).split())[:200]}") from None
        if template is None:
            raise ValueError("this model file has no chat template")
        names = {"messages", "add_generation_prompt", "eos_token", "bos_token", "tools"}
        extra = {k: v for k, v in (template_kwargs or {}).items() if k not in names}
        try:
            text = template.render(
                messages=turns,
                add_generation_prompt=add_generation_prompt,
                eos_token=self.eos_token,
                bos_token=self.bos_token or "",
                tools=None if tools is None else list(tools),
                **extra,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template failed: {' '.join(str(e).split())[:200]}") from None
        if continue_final_message:  # (transformers' rule: cut after the last message's content, stripped)
            last = turns[-1]["content"] if turns else None
            final = last.strip() if isinstance(last, str) else ""
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ValueError("continue_final_message: the last message's text is not in the rendered conversation")
            text = text[: at + len(final)]
        return text


def chat_turn(message: Mapping[str, Any], keep_parts: bool = False) -> dict[str, Any]:
    """A message as a chat template takes it: its role and content a string (OpenAI's text parts joined) or, with
    ``keep_parts``, the parts themselves; other keys (``name``, ``tool_calls``, ...) as they are. A ``ValueError``
    for a message that is not ``{"role": str, "content": str | text parts}``.

    >>> chat_turn({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    {'role': 'user', 'content': 'ab'}
    """
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"a message is a {{role, content}} mapping with a string role; got {message!r:.80}")
    content = message.get("content")
    text = content_text(content)
    if text is None and not (content is None and message.get("tool_calls")):
        raise ValueError(
            "a message's content is a string or text parts "
            f'([{{"type": "text", "text": ...}}]; pagedkv serves text models); got {content!r:.80}'
        )
    return {**message, "content": content if keep_parts and isinstance(content, list) else text}


def content_text(content: Any) -> str | None:
    """A message's text: a string, or OpenAI's content parts when every one is text (joined); None otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        texts = [p.get("text") for p in content]
        return "".join(texts) if all(isinstance(t, str) for t in texts) else None
    return None


def _environment() -> jinja2.Environment:
    """How transformers renders a chat template: a sandbox, blocks trimmed, ``raise_exception`` at hand."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env
