#!/usr/bin/env python3
"""Writes a BERT-large-shaped checkpoint in the Hugging Face layout (`config.json` with
bert-large-uncased's sizes, `model.safetensors` with the encoder's f32 tensors under
`bert.encoder.layer.{i}`), random values, for measuring what `ipuq import` and `ipuq run` do with
a full-depth model. No numpy: the values are windows of one pool of Gaussian numbers (weights and
biases std 0.02, LayerNorm weights 1 +- 0.05), so the file takes seconds, not minutes.

Usage: bert_large_checkpoint.py OUT_DIR [LAYERS]   (24 layers: 1,209,283,480 bytes)
Then:  ipuq import OUT_DIR -o bert-large.toml && ipuq run bert-large.toml
"""
import json
import os
import random
import struct
import sys

HIDDEN, INTER, HEADS = 1024, 4096, 16


def main():
    out = sys.argv[1]
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    os.makedirs(out, exist_ok=True)
    random.seed(7)
    count = 1 << 22
    pool = struct.pack(f"<{count}f", *[random.gauss(0.0, 0.02) for _ in range(count)])
    ones = struct.pack(f"<{HIDDEN}f", *[1.0 + random.gauss(0.0, 0.05) for _ in range(HIDDEN)])

    def window(elements, seed):
        size, start = elements * 4, (seed * 7919 * 4) % (len(pool) - 4)
        data = bytearray()
        while len(data) < size:
            take = min(size - len(data), len(pool) - start)
            data += pool[start:start + take]
            start = 0
        return bytes(data)

    tensors = []  # (name, shape, bytes-maker)
    def dense(name, rows, cols):
        tensors.append((f"{name}.weight", [rows, cols], lambda k=len(tensors): window(rows * cols, k)))
        tensors.append((f"{name}.bias", [rows], lambda k=len(tensors) + 1: window(rows, k)))

    def norm(name):
        tensors.append((f"{name}.weight", [HIDDEN], lambda: ones))
        tensors.append((f"{name}.bias", [HIDDEN], lambda k=len(tensors) + 1: window(HIDDEN, k)))

    for i in range(layers):
        p = f"bert.encoder.layer.{i}"
        for proj in ("query", "key", "value"):
            dense(f"{p}.attention.self.{proj}", HIDDEN, HIDDEN)
        dense(f"{p}.attention.output.dense", HIDDEN, HIDDEN)
        norm(f"{p}.attention.output.LayerNorm")
        dense(f"{p}.intermediate.dense", INTER, HIDDEN)
        dense(f"{p}.output.dense", HIDDEN, INTER)
        norm(f"{p}.output.LayerNorm")

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        elements = 1
        for s in shape:
            elements *= s
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * elements]}
        offset += 4 * elements
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, make in tensors:
            f.write(make())
    config = {
        "architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_hidden_layers": layers,
        "hidden_act": "gelu", "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
        "vocab_size": 30522, "type_vocab_size": 2,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"wrote {len(tensors)} tensors, {offset} bytes, to {out}")


if __name__ == "__main__":
    main()
