#!/usr/bin/env python3
"""Translate with the ONNX export in this folder, using only onnxruntime, numpy and sentencepiece.

    python translate_onnx.py [--beam N] [--batch-size N] [--threads N] < source.txt > translations.txt

Written by nas.export.onnx. The search is a port of nas.model.decode.beam_search (fairseq's
rules: hypotheses ranked by sum log p / len**len_penalty, EOS forced at max_len_a * src_len
+ max_len_b); --beam 1 is greedy decoding. Sentences are batched by length as nas translates.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import sentencepiece as spm

HERE = Path(__file__).resolve().parent


def log_softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float32) - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def topk(x: np.ndarray, k: int) -> np.ndarray:
    """Column indices of the k largest entries of each row of x [r, m], best first."""
    idx = np.argpartition(-x, k - 1, axis=1)[:, :k] if k < x.shape[1] else np.tile(np.arange(x.shape[1]), (len(x), 1))
    vals = np.take_along_axis(x, idx, 1)
    return np.take_along_axis(idx, np.lexsort((idx, -vals), axis=1), 1)


class OnnxTranslator:
    """encoder.onnx + decoder_step.onnx + spm.model, described by onnx.json."""

    def __init__(self, directory: str | Path = HERE, threads: int = 0) -> None:
        directory = Path(directory)
        self.meta = m = json.loads((directory / "onnx.json").read_text(encoding="utf-8"))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        session = lambda name: ort.InferenceSession(str(directory / m[name]["file"]), opts,
                                                    providers=["CPUExecutionProvider"])
        self.encoder, self.decoder = session("encoder"), session("decoder_step")
        self.sp = spm.SentencePieceProcessor(model_file=str(directory / m["spm_model"]))
        self.cross = [e for e in m["cache"] if e["source"] == "encoder"]
        self.state = [e for e in m["cache"] if e["source"] == "step"]
        self.enc_outputs = [o["name"] for o in m["encoder"]["outputs"]]
        self.dec_outputs = ["logits", *[e["output"] for e in self.state]]

    def encode(self, src: np.ndarray):
        """src [b, s] int64 -> memory [b, s, C], src_pad [b, s], {cross name: tensor}."""
        out = dict(zip(self.enc_outputs, self.encoder.run(self.enc_outputs, {"src": src})))
        return out["memory"], out["src_pad"], {e["input"]: out[e["output"]] for e in self.cross}

    def initial_state(self, n: int) -> dict:
        """Zero step state for n rows (past length 0)."""
        shape = lambda e: [n if d == "batch" else 0 if d == "past_len" else d for d in e["shape"]]
        return {e["input"]: np.zeros(shape(e), np.float32) for e in self.state}

    def step(self, tokens, memory, src_pad, cross, state):
        """tokens [n, 1] -> logits [n, V] and the new state."""
        out = self.decoder.run(self.dec_outputs, {"tokens": tokens, "memory": memory, "src_pad": src_pad,
                                                  **cross, **state})
        return out[0], {e["input"]: t for e, t in zip(self.state, out[1:])}

    def beam_search(self, src: np.ndarray, beam_size: int, min_len: int = 0,
                    max_len: int | None = None) -> list[list[int]]:
        """Best hypothesis per sentence of src [b, s] (ids without BOS/EOS); no EOS before step min_len, and
        max_len (steps) replaces the max_len_a * src_len + max_len_b bound when given."""
        m, k = self.meta, beam_size
        bos, eos, vocab = m["bos_id"], m["eos_id"], m["vocab_size"]
        bsz = src.shape[0]
        memory, src_pad, cross = self.encode(src)
        src_len = (~src_pad).sum(1)
        max_len = np.minimum((src_len.astype(np.float32) * np.float32(m["max_len_a"]) + np.float32(m["max_len_b"]))
                             .astype(np.int64) if max_len is None else np.full(bsz, max_len), m["max_positions"] - 1)
        rows = np.repeat(np.arange(bsz), k)  # beam row -> sentence
        memory, src_pad = memory[rows], src_pad[rows]
        cross = {e["input"]: np.take(cross[e["input"]], rows, axis=e["batch_axis"]) for e in self.cross}
        state = self.initial_state(bsz * k)
        tokens = np.full((bsz * k, 1), bos, dtype=np.int64)
        never = sorted({m["pad_id"], bos} - {eos})
        scores = np.zeros((bsz, k), np.float32)
        scores[:, 1:] = -np.inf  # the first step expands beam 0 only
        active = np.arange(bsz)
        finished: list[list] = [[] for _ in range(bsz)]
        step = 0
        while active.size > 0:
            n_act = active.size
            logits, state = self.step(tokens[:, -1:], memory, src_pad, cross, state)
            lprobs = log_softmax(logits).reshape(n_act, k, vocab)
            lprobs[..., never] = -np.inf  # PAD and BOS are never emitted (as nas.model.decode.beam_search)
            at_limit = (step + 1) >= max_len[active]
            if step + 1 < min_len:
                lprobs[..., eos] = -np.inf
            if at_limit.any():
                forced = np.full_like(lprobs[at_limit], -np.inf)
                forced[..., eos] = lprobs[at_limit][..., eos] if step + 1 >= min_len else 0.0
                lprobs[at_limit] = forced
            cand = (scores[:, :, None] + lprobs).reshape(n_act, k * vocab)
            top_idx = topk(cand, 2 * k)
            top_scores = np.take_along_axis(cand, top_idx, 1)
            top_beam, top_tok = top_idx // vocab, top_idx % vocab
            is_eos = (top_tok == eos) & np.isfinite(top_scores)
            norm = float(step + 1) ** m["len_penalty"]
            for i, j in np.argwhere(is_eos[:, :k]):
                sid = int(active[i])
                if len(finished[sid]) < k:
                    hyp = tokens[i * k + int(top_beam[i, j]), 1:].tolist()
                    finished[sid].append((float(top_scores[i, j]) / norm, hyp))
            cont = np.where(is_eos, -np.inf, top_scores).astype(np.float32)
            pick = topk(cont, k)
            cont_scores = np.take_along_axis(cont, pick, 1)
            next_beam, next_tok = np.take_along_axis(top_beam, pick, 1), np.take_along_axis(top_tok, pick, 1)
            done = np.array([len(finished[int(s)]) >= k for s in active]) | at_limit
            keep = np.flatnonzero(~done)
            src_rows = (keep[:, None] * k + next_beam[keep]).reshape(-1)
            tokens = np.concatenate([tokens[src_rows], next_tok[keep].reshape(-1, 1)], 1)
            scores = cont_scores[keep]
            state = {e["input"]: np.take(state[e["input"]], src_rows, axis=e["batch_axis"]) for e in self.state}
            if keep.size < n_act:
                sent_rows = (keep[:, None] * k + np.arange(k)).reshape(-1)
                cross = {e["input"]: np.take(cross[e["input"]], sent_rows, axis=e["batch_axis"]) for e in self.cross}
                memory, src_pad = memory[sent_rows], src_pad[sent_rows]
            active = active[keep]
            step += 1
        return [max(hyps, key=lambda h: h[0])[1] for hyps in finished]

    def translate(self, sentences: list[str], beam_size: int | None = None, batch_size: int = 64) -> list[str]:
        """Detokenized translations in input order."""
        m = self.meta
        eos, pad = m["eos_id"], m["pad_id"]
        ids = [x[: m["max_src_tokens"] - 1] + [eos] for x in self.sp.encode(list(sentences), out_type=int)]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out: list[list[int]] = [[] for _ in ids]
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            src = np.full((len(chunk), max(len(ids[i]) for i in chunk)), pad, dtype=np.int64)
            for row, i in enumerate(chunk):
                src[row, : len(ids[i])] = ids[i]
            for i, hyp in zip(chunk, self.beam_search(src, beam_size or m["beam_size"])):
                out[i] = hyp
        strip = lambda h: [t for t in (h[: h.index(eos)] if eos in h else h) if t not in (pad, m["bos_id"])]
        return [self.sp.decode(strip(h)) for h in out]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Translate stdin (one sentence a line) to stdout.")
    parser.add_argument("--beam", type=int, default=None, help="beam size (default: the export's; 1 = greedy)")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: all cores)")
    parser.add_argument("--dir", type=Path, default=HERE, help="the ONNX folder (default: this script's)")
    args = parser.parse_args(argv)
    if args.beam is not None and args.beam < 1:
        parser.error(f"--beam {args.beam} must be >= 1")
    lines = [line.strip() for line in sys.stdin]
    for hyp in OnnxTranslator(args.dir, args.threads).translate(lines, args.beam, args.batch_size):
        sys.stdout.write(hyp + "\n")


if __name__ == "__main__":
    main()
