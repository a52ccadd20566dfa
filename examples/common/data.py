"""Data for the examples: real text that ships with Python (offline), or a tensorflow-datasets name.

Offline default, "pydoc": the English text of Python's own documentation topics
(`pydoc_data.topics`, the text `help("for")` prints; ~465k characters, 79 topics, Python
Software Foundation licence). It ships with every CPython, so the examples train on real text
on a fresh machine without a download. Bytes are the tokens (vocabulary 256); the last 10% of
the text is held out for evaluation.

Through tensorflow-datasets (downloaded on first use, so the network must be there; offline,
`prepare` says so within seconds, before any download starts):

    tiny_shakespeare                   character-level language modelling (like "pydoc")
    imdb_reviews                       text classification (positive/negative), byte tokens
    mnist, fashion_mnist, cifar10      image classification

Every training stream is cached, shuffled, repeated and batched. Epoch e's stream is shuffled with
a seed drawn from (seed, e): the same seed gives the same batches in every run and every process,
which is what the float32 comparison and a resumed run (`--resume`) rely on.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:  # TensorFlow loads with the data, not with the flags (`--help` stays instant)
    import tensorflow as tf

OFFLINE = ("pydoc",)
TFDS_LM = ("tiny_shakespeare",)
TFDS_TEXT_CLASSES = {"imdb_reviews": 2}
TFDS_IMAGE_CLASSES = {"mnist": 10, "fashion_mnist": 10, "cifar10": 10}
DATASETS = OFFLINE + TFDS_LM + tuple(TFDS_TEXT_CLASSES) + tuple(TFDS_IMAGE_CLASSES)
TEXT_DATASETS = OFFLINE + TFDS_LM + tuple(TFDS_TEXT_CLASSES)
VOCAB = 256  # byte tokens
EVAL_FRACTION = 0.1
# Where tensorflow-datasets' own files live; reachable means "online" for the fast offline check.
PROBE_HOST, PROBE_PORT = "storage.googleapis.com", 443
PROBE_TIMEOUT_S = 5.0


class DataUnavailable(RuntimeError):
    """A tensorflow-datasets set that is not on disk and cannot be downloaded now."""


@dataclasses.dataclass(frozen=True)
class Data:
    """A training stream and a held-out set.

    Args:
        name: String. The data set name.
        task: String. "lm" (next-token prediction at every position) or "classify".
        train_epoch: Callable. epoch -> that epoch's training stream, infinite, shuffled, batched
            `(inputs, labels)`: the same batches for the same seed and epoch in every process.
        eval: tf.data.Dataset. Finite, batched `(inputs, labels)`.
        input_shape: Tuple. Shape of one example's inputs.
        input_dtype: String. "int32" (tokens) or "float32" (pixels).
        num_classes: Int. Vocabulary size (lm) or number of classes.
        source: String. Where the data came from, for people.
    """

    name: str
    task: str
    train_epoch: Callable[[int], tf.data.Dataset]
    eval: tf.data.Dataset
    input_shape: tuple
    input_dtype: str
    num_classes: int
    source: str

    @property
    def train(self) -> tf.data.Dataset:
        """Epoch 0's training stream."""
        return self.train_epoch(0)


def pydoc_text() -> str:
    """The documentation topics that ship with Python, in a fixed order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))


def _byte_tokens(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def _lm_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Consecutive windows of `seq_len + 1` tokens (inputs and shifted targets), stride `seq_len`."""
    if tokens.size < seq_len + 1:
        # Only tiny texts (tfds mock data in tests) get here: repeat them to one window.
        tokens = np.tile(tokens, (seq_len + 1) // max(tokens.size, 1) + 1)
    count = (tokens.size - 1) // seq_len
    index = np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return tokens[index]


def _split_lm(window):
    return window[:-1], window[1:]


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of epoch `epoch`'s stream: a function of (seed, epoch) only."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def _stream(ds: tf.data.Dataset, batch_size: int, seed: int, size: int) -> Callable[[int], tf.data.Dataset]:
    """epoch -> that epoch's training stream: cache -> shuffle(epoch_seed) -> repeat -> batch.

    Not one stream reshuffled per iterator: TensorFlow derives each new iterator's order from how many
    were made before in this process, so a resumed run would replay epoch 0's batches.
    """
    import tensorflow as tf

    cached = ds.cache()

    def for_epoch(epoch: int) -> tf.data.Dataset:
        return (cached.shuffle(max(size, 1), seed=epoch_seed(seed, epoch), reshuffle_each_iteration=True).repeat()
                .batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE))

    return for_epoch


def _lm_data(name: str, train_text: str, eval_text: str, source: str, *, seq_len: int,
             batch_size: int, seed: int) -> Data:
    import tensorflow as tf

    train = _lm_windows(_byte_tokens(train_text), seq_len)
    held_out = _lm_windows(_byte_tokens(eval_text), seq_len)
    stream = _stream(tf.data.Dataset.from_tensor_slices(train).map(_split_lm), batch_size, seed, len(train))
    eval_ds = tf.data.Dataset.from_tensor_slices(held_out).map(_split_lm).batch(batch_size)
    return Data(name, "lm", stream, eval_ds, (seq_len,), "int32", VOCAB,
                f"{source}: {len(train)} training and {len(held_out)} held-out windows of {seq_len} bytes")


def _unreachable(host: str, port: int, timeout: float) -> str | None:
    """None when a TCP connection to `host:port` opens within `timeout` seconds, else why not.

    The connection runs in a thread: a DNS lookup without an answer can block for much longer
    than `timeout` (the resolver's own retries), and the caller must not wait for it.
    """
    outcome: list[str | None] = []

    def connect():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=connect, name="network-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


def _probe_address() -> tuple[str, int]:
    """The HTTPS proxy when one is configured (downloads go through it), else `PROBE_HOST`."""
    proxy = urllib.request.getproxies().get("https")
    if proxy:
        parsed = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if parsed.hostname:
            return parsed.hostname, parsed.port or 80
    return PROBE_HOST, PROBE_PORT


def _partial_files(root: Path) -> set[Path]:
    """tensorflow-datasets' unfinished downloads (*.tmp.*) and preparations (incomplete.*)."""
    if not root.is_dir():
        return set()
    return {p for pattern in ("**/*.tmp.*", "**/incomplete.*") for p in root.glob(pattern)}


def _remove(paths) -> None:
    import shutil

    for path in sorted(paths, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()


def prepare(name: str, data_dir: str | None = None) -> None:
    """Makes sure tensorflow-datasets set `name` is on disk: downloads it when it is not.

    Offline, fails within `PROBE_TIMEOUT_S` seconds (a TCP connection to tensorflow-datasets'
    host, or to the HTTPS proxy, before the download starts) instead of after the downloader's
    retries. A failed download removes the partial files it left. "pydoc" needs nothing.

    Raises:
        DataUnavailable: the set is not on disk and cannot be downloaded now; the message says
            what to do instead.
    """
    if name not in DATASETS:
        raise ValueError(f"Unknown `dataset`. Received: dataset={name!r}. Allowed: {', '.join(DATASETS)}")
    if name in OFFLINE:
        return
    import tensorflow_datasets as tfds

    builder = tfds.builder(name, data_dir=data_dir)
    # is_prepared() logs a warning for a folder without dataset_info.json: look first.
    if (Path(builder.data_dir) / "dataset_info.json").exists() and builder.is_prepared():
        return
    root = Path(builder.data_dir_root)
    offline = (f"The offline default is --dataset=pydoc (Python's documentation text, no download). "
               f"To use {name} offline, download it where there is a network: python -c \"import "
               f"tensorflow_datasets as tfds; tfds.builder('{name}', data_dir='DIR').download_and_prepare()\", "
               f"then copy DIR here and pass --data_dir=DIR.")
    host, port = _probe_address()
    problem = _unreachable(host, port, PROBE_TIMEOUT_S)
    if problem is not None:
        raise DataUnavailable(f"--dataset={name} is not in {root} and the network is unreachable "
                              f"({host}:{port}: {problem}). {offline}")
    before = _partial_files(root)
    try:
        builder.download_and_prepare()
    except Exception as e:  # network, disk or checksum: the download did not finish
        _remove(_partial_files(root) - before)
        reason = " ".join(str(e).split())[:300]
        raise DataUnavailable(f"--dataset={name}: the download into {root} failed ({type(e).__name__}: "
                              f"{reason}); its partial files are removed. {offline}") from e


def _tfds_load(name: str, split: str, data_dir: str | None):
    import tensorflow_datasets as tfds

    prepare(name, data_dir)
    return tfds.load(name, split=split, data_dir=data_dir, shuffle_files=False, download=False)


def _tfds_text(name: str, split: str, data_dir: str | None) -> str:
    parts = [example["text"].numpy().decode("utf-8", "replace") for example in _tfds_load(name, split, data_dir)]
    return "\n".join(parts)


def _bytes_fixed(text, seq_len: int):
    """A string tensor -> `seq_len` byte tokens (truncated, zero-padded)."""
    import tensorflow as tf

    tokens = tf.cast(tf.io.decode_raw(tf.strings.substr(text, 0, seq_len), tf.uint8), tf.int32)
    return tf.pad(tokens, [[0, seq_len - tf.shape(tokens)[0]]])


def _text_classes(name: str, *, seq_len: int, batch_size: int, seed: int, data_dir: str | None,
                  max_examples: int | None) -> Data:
    import tensorflow as tf

    def encode(example):
        tokens = tf.ensure_shape(_bytes_fixed(example["text"], seq_len), (seq_len,))
        return tokens, tf.cast(example["label"], tf.int32)

    train = _tfds_load(name, "train", data_dir)
    held_out = _tfds_load(name, "test", data_dir)
    if max_examples:
        train, held_out = train.take(max_examples), held_out.take(max_examples // 4 or 1)
    size = max_examples or 25_000
    stream = _stream(train.map(encode), batch_size, seed, size)
    return Data(name, "classify", stream, held_out.map(encode).batch(batch_size), (seq_len,), "int32",
                TFDS_TEXT_CLASSES[name], f"tensorflow-datasets {name}: first {seq_len} bytes of each review")


def _images(name: str, *, batch_size: int, seed: int, data_dir: str | None, max_examples: int | None) -> Data:
    import tensorflow as tf

    def encode(example):
        return tf.cast(example["image"], tf.float32) / 255.0, tf.cast(example["label"], tf.int32)

    train = _tfds_load(name, "train", data_dir)
    held_out = _tfds_load(name, "test", data_dir)
    if max_examples:
        train, held_out = train.take(max_examples), held_out.take(max_examples // 4 or 1)
    shape = tuple(train.element_spec["image"].shape)
    size = max_examples or 10_000
    stream = _stream(train.map(encode), batch_size, seed, size)
    return Data(name, "classify", stream, held_out.map(encode).batch(batch_size), shape, "float32",
                TFDS_IMAGE_CLASSES[name], f"tensorflow-datasets {name}: images {shape}")


def load(name: str, *, seq_len: int = 128, batch_size: int = 32, seed: int = 0, data_dir: str | None = None,
         max_examples: int | None = None) -> Data:
    """Loads a data set by name (see the module docstring).

    Args:
        name: String. One of `DATASETS`.
        seq_len: Int. Tokens per example (text data sets).
        batch_size: Int. Examples per batch, training and evaluation.
        seed: Int. Shuffle seed.
        data_dir: String or None. tensorflow-datasets data directory (None: its default).
        max_examples: Int or None. Use only this many training examples of a tfds
            classification set (and a quarter as many held out); None uses all.
    """
    if name not in DATASETS:
        raise ValueError(f"Unknown `dataset`. Received: dataset={name!r}. Allowed: {', '.join(DATASETS)}")
    if name == "pydoc":
        text = pydoc_text()
        cut = int(len(text) * (1 - EVAL_FRACTION))
        return _lm_data(name, text[:cut], text[cut:], "Python's pydoc_data.topics (offline)",
                        seq_len=seq_len, batch_size=batch_size, seed=seed)
    if name in TFDS_LM:
        return _lm_data(name, _tfds_text(name, "train", data_dir), _tfds_text(name, "validation", data_dir),
                        f"tensorflow-datasets {name}", seq_len=seq_len, batch_size=batch_size, seed=seed)
    if name in TFDS_TEXT_CLASSES:
        return _text_classes(name, seq_len=seq_len, batch_size=batch_size, seed=seed, data_dir=data_dir,
                             max_examples=max_examples)
    return _images(name, batch_size=batch_size, seed=seed, data_dir=data_dir, max_examples=max_examples)
