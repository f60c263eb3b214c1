"""A slow tiktoken tokenizer laid out like Kimi-K2.5's `tokenization_kimi.py` (written for eagle3's tests).

What matters to eagle3 is copied from the real one's interface, not its code:
- a `PreTrainedTokenizer` (slow, Python) subclass named `TikTokenTokenizer`, loaded through
  `auto_map` in tokenizer_config.json, so only with `trust_remote_code=True`;
- its vocabulary is `tiktoken.model` (base64 token, rank per line) read with `load_tiktoken_bpe`,
  followed by 256 + 2 special ids named from `added_tokens_decoder` in tokenizer_config.json
  (unnamed ones read `<|reserved_token_{id}|>`);
- `encode` without keyword arguments goes straight to tiktoken with every special token allowed;
- no fast backend, hence no character offsets.
"""
from __future__ import annotations

import os
from pathlib import Path
from shutil import copyfile

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}

# Letters (with an English contraction), 1-3 digits, punctuation runs, newlines, other spaces.
PATTERN = (
    r"""[^\r\n\p{L}\p{N}]?\p{L}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = 256

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 additional_special_tokens=None, added_tokens_decoder=None, **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        n_base = len(ranks)
        names = {int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {}).items()}
        self.special_tokens = {
            names.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(n_base, n_base + self.num_reserved_special_tokens + 2)
        }
        self.vocab_file = vocab_file
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=PATTERN, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.n_words = self.model.n_vocab
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.decoder = {
            i: "".join(self.byte_encoder[b] for b in self.model.decode_single_token_bytes(i))
            for i in range(self.n_words)
        }
        self.encoder = {s: i for i, s in self.decoder.items()}
        self.bos_id, self.eos_id = self.special_tokens[str(bos_token)], self.special_tokens[str(eos_token)]
        pad_token = pad_token or "<|reserved_token_{}|>".format(n_base + 250)
        unk_token = unk_token or "<|reserved_token_{}|>".format(n_base + 249)
        if additional_special_tokens is None:
            additional_special_tokens = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                         "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens, **kwargs)

    def encode(self, text: str, allow_special_tokens: bool = True, **kwargs):
        if kwargs:
            return super().encode(text, **kwargs)
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode(text, disallowed_special=())

    def decode(self, token_ids, **kwargs):
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.model.encode(text, allowed_special="all")]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.encoder.get(str(self.unk_token)))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return bytearray(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)
