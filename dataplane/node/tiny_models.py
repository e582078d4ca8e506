"""Tiny real checkpoints made locally (no hub): random weights, real configs, `save_pretrained`.

    python -m dataplane.node.tiny_models DIR            # DIR/tiny-gpt2 and DIR/tiny-llama
    python -m dataplane.node.tiny_models DIR --mb 300   # also DIR/gpt2-300mb, big enough to time loads

The checkpoints are deterministic (seeded), so the same input gives the same output on every
replica and every machine. COLD means "on disk" for real: these are what replicas load.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

EOS = 256  # "<|endoftext|>" in the byte-level tokenizer below


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer (256 byte tokens + <|endoftext|> = 256), so prompts work offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",  # type: ignore[no-untyped-call]
                            bos_token="<|endoftext|>").save_pretrained(path)


def _make(path: Path | str, seed: int, build: Callable[[], Any]) -> Path:
    """Save `build()` (a model with random weights, seeded) and the tokenizer at `path`, once."""
    import torch

    path = Path(path)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    torch.manual_seed(seed)
    build().eval().save_pretrained(path)
    save_byte_tokenizer(path)
    return path


def make_tiny_gpt2(path: Path | str, *, n_layer: int = 2, n_embd: int = 64, vocab_size: int = 1000,
                   seed: int = 0) -> Path:
    """A 2-layer GPT-2 with random weights saved at `path` (skipped when already there)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 32), n_positions=128,
                     vocab_size=vocab_size, bos_token_id=EOS, eos_token_id=EOS)
    return _make(path, seed, lambda: GPT2LMHeadModel(cfg))


def make_tiny_llama(path: Path | str, *, layers: int = 2, hidden: int = 64, vocab_size: int = 1000,
                    seed: int = 1) -> Path:
    """A small Llama-architecture model with random weights saved at `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                      max_position_embeddings=128, bos_token_id=EOS, eos_token_id=EOS)
    return _make(path, seed, lambda: LlamaForCausalLM(cfg))


def make_gpt2_of_size(path: Path | str, megabytes: int, seed: int = 2) -> Path:
    """A GPT-2 of roughly `megabytes` MB of float32 weights (for load-time benchmarks)."""
    n_embd = 512
    per_layer = 12 * n_embd * n_embd * 4  # attention + MLP weights, float32
    layers = max(1, (megabytes * 10**6 - 1000 * n_embd * 4) // per_layer)
    return make_tiny_gpt2(path, n_layer=int(layers), n_embd=n_embd, seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--mb", type=int, help="also make a GPT-2 of about this many MB")
    a = p.parse_args(argv)
    made = [make_tiny_gpt2(a.dir / "tiny-gpt2"), make_tiny_llama(a.dir / "tiny-llama")]
    if a.mb:
        made.append(make_gpt2_of_size(a.dir / f"gpt2-{a.mb}mb", a.mb))
    for m in made:
        size = sum(f.stat().st_size for f in m.iterdir())
        print(f"{m}  ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
