"""Write tests/fixtures/openai_tf_tiny/: a tiny random GPT-2 saved by real TensorFlow, as OpenAI did.

The tests read it back without TensorFlow (gpt2kit.checkpoint.tf_bundle) and compare against
reference.npz, the values TensorFlow itself reported. TensorFlow is needed only here; keep it
out of the project's venv:

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu numpy
    /tmp/tfvenv/bin/python scripts/make_tf_fixture.py

Variable names, shapes and the Saver call follow openai/gpt-2 (src/model.py, and the
checkpoint layout of its released models): conv1d weights are [1, nx, nf].
Config: n_vocab=1000 (not 50257, to keep the fixture ~250 KB), n_ctx=64, n_embd=32,
n_head=4, n_layer=2. Seeded, so reruns give the same values.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

HPARAMS = {"n_vocab": 1000, "n_ctx": 64, "n_embd": 32, "n_head": 4, "n_layer": 2}
SEED = 1234
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "openai_tf_tiny"


def gpt2_variables(hp: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """OpenAI's GPT-2 variable names -> random float32 values (gains near 1, the rest small)."""
    C, V, T = hp["n_embd"], hp["n_vocab"], hp["n_ctx"]

    def normal(*shape: int, std: float = 0.02, mean: float = 0.0) -> np.ndarray:
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    out = {"model/wte": normal(V, C), "model/wpe": normal(T, C, std=0.01)}
    for i in range(hp["n_layer"]):
        h = f"model/h{i}"
        out[f"{h}/ln_1/g"] = normal(C, std=0.1, mean=1.0)
        out[f"{h}/ln_1/b"] = normal(C)
        out[f"{h}/attn/c_attn/w"] = normal(1, C, 3 * C)
        out[f"{h}/attn/c_attn/b"] = normal(3 * C)
        out[f"{h}/attn/c_proj/w"] = normal(1, C, C)
        out[f"{h}/attn/c_proj/b"] = normal(C)
        out[f"{h}/ln_2/g"] = normal(C, std=0.1, mean=1.0)
        out[f"{h}/ln_2/b"] = normal(C)
        out[f"{h}/mlp/c_fc/w"] = normal(1, C, 4 * C)
        out[f"{h}/mlp/c_fc/b"] = normal(4 * C)
        out[f"{h}/mlp/c_proj/w"] = normal(1, 4 * C, C)
        out[f"{h}/mlp/c_proj/b"] = normal(C)
    out["model/ln_f/g"] = normal(C, std=0.1, mean=1.0)
    out["model/ln_f/b"] = normal(C)
    return out


def save_with_tensorflow(values: dict[str, np.ndarray], out_dir: Path) -> dict[str, np.ndarray]:
    """Save ``values`` with tf.compat.v1.train.Saver; return what TF reports the variables hold."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf1 = tf.compat.v1
    tf1.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf1.get_variable(name, initializer=value) for name, value in values.items()]
        saver = tf1.train.Saver(var_list=variables, save_relative_paths=True)
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            saver.save(sess, str(out_dir / "model.ckpt"), write_meta_graph=False)
            read_back = sess.run(variables)
    return {v.op.name: np.asarray(a) for v, a in zip(variables, read_back, strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("model.ckpt*"):
        stale.unlink()

    values = gpt2_variables(HPARAMS, np.random.default_rng(SEED))
    saved = save_with_tensorflow(values, out_dir)
    assert saved.keys() == values.keys(), sorted(set(saved) ^ set(values))
    for name, value in values.items():
        assert np.array_equal(saved[name], value) and saved[name].dtype == np.float32, name

    (out_dir / "hparams.json").write_text(json.dumps(HPARAMS, indent=2) + "\n")
    np.savez(out_dir / "reference.npz", **saved)
    meta = out_dir / "model.ckpt.meta"
    if meta.exists():
        meta.unlink()
    for path in sorted(out_dir.iterdir()):
        print(f"{path.stat().st_size:>9}  {path}")


if __name__ == "__main__":
    main()
