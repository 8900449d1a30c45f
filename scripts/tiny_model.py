"""Writes the tiny model the real-engine tests and benchmarks serve, and its LoRA adapters.

    python scripts/tiny_model.py OUT_DIR TOKENIZER_DIR [--adapters N]

OUT_DIR gets a small Llama's `config.json` and `generation_config.json` (vLLM serves it with
`--load-format dummy`: random weights, nothing downloaded), the tokenizer of TOKENIZER_DIR (its
`tokenizer.json` and `tokenizer_config.json`, chat template included), and under `lora/` N random
rank-8 adapters in PEFT layout (`adapter_config.json` and `adapter_model.safetensors` with
`q_proj`/`v_proj` A and B matrices). Run with the vLLM venv's python (torch and safetensors).
Idempotent: files already there with the same content are left alone, so engines started from the
directory see the same model every run.
"""

import argparse
import json
import os
import shutil
import sys

HIDDEN = 256
LAYERS = 2
HEADS = 4
HEAD_DIM = 64
RANK = 8


def write_json(path, value):
    text = json.dumps(value, indent=1, sort_keys=True) + "\n"
    if os.path.exists(path) and open(path).read() == text:
        return
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def vocab_size(tokenizer_json):
    """One more than the largest id the tokenizer can emit, rounded up to a multiple of 64."""
    with open(tokenizer_json) as f:
        tok = json.load(f)
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    top = max(ids) + 1
    return (top + 63) // 64 * 64, tok


def special_id(tok, content):
    for t in tok.get("added_tokens", []):
        if t["content"] == content:
            return t["id"]
    return None


def adapter(dir_path, seed, base):
    import torch
    from safetensors.torch import save_file

    os.makedirs(dir_path, exist_ok=True)
    write_json(
        os.path.join(dir_path, "adapter_config.json"),
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base,
            "r": RANK,
            "lora_alpha": 2 * RANK,
            "lora_dropout": 0.0,
            "target_modules": ["q_proj", "v_proj"],
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
        },
    )
    weights = os.path.join(dir_path, "adapter_model.safetensors")
    if os.path.exists(weights):
        return
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(HEADS * HEAD_DIM, RANK, generator=g) * 0.01
    save_file(tensors, weights + ".tmp")
    os.replace(weights + ".tmp", weights)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("tokenizer")
    p.add_argument("--adapters", type=int, default=2)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    vocab, tok = vocab_size(os.path.join(a.tokenizer, "tokenizer.json"))
    with open(os.path.join(a.tokenizer, "tokenizer_config.json")) as f:
        tcfg = json.load(f)

    def content(key):
        v = tcfg.get(key)
        return v.get("content") if isinstance(v, dict) else v

    bos = special_id(tok, content("bos_token"))
    eos = special_id(tok, content("eos_token"))
    write_json(
        os.path.join(a.out, "config.json"),
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": HEADS,
            "head_dim": HEAD_DIM,
            "vocab_size": vocab,
            "max_position_embeddings": 16384,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "bos_token_id": bos,
            "eos_token_id": eos,
        },
    )
    write_json(os.path.join(a.out, "generation_config.json"), {"bos_token_id": bos, "eos_token_id": eos})
    src = os.path.join(a.tokenizer, "tokenizer.json")
    dst = os.path.join(a.out, "tokenizer.json")
    if not os.path.exists(dst) or os.path.getsize(dst) != os.path.getsize(src):
        shutil.copyfile(src, dst + ".tmp")
        os.replace(dst + ".tmp", dst)
    # The tokenizer as tokenizer.json defines it (no model-specific class rebuilding its pipeline),
    # special tokens as plain strings (transformers 5 refuses the `{"content": ...}` form).
    special = {k: content(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in tcfg}
    write_json(
        os.path.join(a.out, "tokenizer_config.json"),
        dict(tcfg, tokenizer_class="PreTrainedTokenizerFast", **special),
    )
    for i in range(a.adapters):
        adapter(os.path.join(a.out, "lora", f"adapter-{i}"), 1000 + i, a.out)
    print(a.out)


if __name__ == "__main__":
    sys.exit(main())
