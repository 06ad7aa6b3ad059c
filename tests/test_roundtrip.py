"""End-to-end save/load round trips through the public API, compared bit for bit."""

from __future__ import annotations

import os
import struct
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import ckptio
from conftest import ALL_DTYPES
from special_values import bits_equal, rand, raw
from ckptio.format import manifest
from ckptio.errors import (CheckpointNotFoundError, CkptError, CorruptCheckpointError,
                           IncompleteCheckpointError, PickleRefusedError, StateMismatchError,
                           UnsupportedStateError)

MiB = 1 << 20


def data_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.startswith("data-"))


def read_manifest(path):
    where = os.path.join(path, manifest.MANIFEST_NAME)
    with open(where, "rb") as f:
        return manifest.decode(f.read(), where)


def float_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", b))[0]


class Point:  # a plain object without a pickle-free encoding (module level: picklable)
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


# --------------------------------------------------------------------------------------------
# dtypes and tensor layouts


def dtype_state(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    return {
        "contig": rand(dtype, (33, 17), seed),
        "scalar": rand(dtype, (), seed + 1),
        "empty": rand(dtype, (0, 3), seed + 2),
        "empty3": rand(dtype, (4, 0, 2), seed + 3),
        "transposed": rand(dtype, (24, 40), seed + 4).t(),
        "stepped": rand(dtype, (50, 30), seed + 5)[::3, 1::2],
        "narrow": rand(dtype, (4096,), seed + 6)[100:164],
        "expanded": rand(dtype, (1, 7), seed + 7).expand(5, 7),
        "permuted": rand(dtype, (4, 5, 6), seed + 8).permute(2, 0, 1),
        "stepped1d": rand(dtype, (300,), seed + 9)[::7],
    }


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_and_layout_round_trips_bitwise(dtype, ckpt_dir, small_options):
    state = dtype_state(dtype, seed=11)
    originals = {k: v.clone() for k, v in state.items()}
    ckptio.save(state, ckpt_dir, options=small_options)

    fresh = ckptio.load(ckpt_dir)
    assert sorted(fresh) == sorted(state)
    for key, want in originals.items():
        got = fresh[key]
        assert isinstance(got, torch.Tensor), key
        assert bits_equal(got, want), key

    # in place, into destinations of the same layout where one can be written
    dest = dtype_state(dtype, seed=99)
    dest["expanded"] = rand(dtype, (5, 7), 1234)  # an expanded tensor cannot be a destination
    objects = {k: v for k, v in dest.items()}
    report = ckptio.load(ckpt_dir, dest)
    assert sorted(report.loaded) == sorted(state)
    for key, want in originals.items():
        assert dest[key] is objects[key], f"{key}: tensor replaced instead of filled"
        assert bits_equal(dest[key], want), key


def test_special_float_values_in_tensors_are_bit_exact(ckpt_dir, small_options):
    specials64 = [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0x7FF4000000000123,
                  0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000, 0x0000000000000001]
    t64 = torch.from_numpy(np.array(specials64, dtype=np.uint64).view(np.float64))
    specials32 = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x80000000, 0x7F800000, 0x00000001]
    t32 = torch.from_numpy(np.array(specials32, dtype=np.uint32).view(np.float32))
    t16 = torch.from_numpy(np.array([0x7E00, 0xFE00, 0x7C01, 0x8000], dtype=np.uint16).view(np.float16))
    state = {"f64": t64, "f32": t32, "f16": t16, "c": torch.complex(t32, t32.flip(0))}
    ckptio.save(state, ckpt_dir, options=small_options)
    fresh = ckptio.load(ckpt_dir)
    for key in state:
        assert bits_equal(fresh[key], state[key]), key


def test_expanded_tensor_writes_only_the_views_elements(ckpt_dir, small_options):
    row = torch.randn(1, 300)
    view = row.expand(500, 300)  # 600 KB of elements over a 1.2 KB storage
    result = ckptio.save({"e": view}, ckpt_dir, options=small_options)
    assert result.nbytes == 500 * 300 * 4
    assert 500 * 300 * 4 <= data_bytes(ckpt_dir) <= 500 * 300 * 4 + 4096
    got = ckptio.load(ckpt_dir)["e"]
    assert got.shape == (500, 300)
    assert torch.equal(got, view)
    got[0, 0] += 1  # a fresh load holds its own elements, not a stride-0 view
    assert got[1, 0] == view[1, 0]


def test_narrow_slice_of_big_storage_writes_only_the_slice(ckpt_dir, small_options):
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB storage
    state = {"head": big[1000:1010], "cols": big.view(1024, 1024)[:3, 7:9]}
    result = ckptio.save(state, ckpt_dir, options=small_options)
    assert result.nbytes == (10 + 6) * 4
    assert data_bytes(ckpt_dir) <= 4096, "the whole storage was written, not the view"
    fresh = ckptio.load(ckpt_dir)
    assert bits_equal(fresh["head"], state["head"])
    assert bits_equal(fresh["cols"], state["cols"])
    assert fresh["head"].untyped_storage().nbytes() < 1 << 20


def test_large_non_contiguous_tensors_cross_buffer_boundaries(ckpt_dir, small_options):
    assert small_options.buffer_bytes == 1 * MiB
    state = {
        # 2.5 MB, rows of 700 elements: buffers end in the middle of a row
        "t": torch.randn(700, 900).t(),
        "c128": rand(torch.complex128, (300, 310), 1).t(),  # 1.5 MB, itemsize 16
        "perm": rand(torch.int16, (100, 120, 90), 2).permute(2, 0, 1),  # 2.2 MB, 3-D
        "step": rand(torch.bfloat16, (400, 3, 1500), 3)[::2, 1:, ::3],  # 3-D stepped slice
        "small": torch.arange(5),
    }
    for key in ("t", "c128", "perm"):
        assert not state[key].is_contiguous()
        assert state[key].numel() * state[key].element_size() > small_options.buffer_bytes
    originals = {k: v.clone() for k, v in state.items()}
    ckptio.save(state, ckpt_dir, options=small_options)

    fresh = ckptio.load(ckpt_dir)
    for key, want in originals.items():
        assert bits_equal(fresh[key], want), key

    # in place into non-contiguous destinations: the element order must follow the view
    dest = {
        "t": torch.zeros(700, 900).t(),  # (900, 700) view with transposed strides
        "c128": torch.zeros(300, 310, dtype=torch.complex128).t(),
        "perm": torch.zeros(100, 120, 90, dtype=torch.int16).permute(2, 0, 1),
        "step": torch.zeros(500, 200, 2, dtype=torch.bfloat16).permute(1, 2, 0),
        "small": torch.zeros(5, dtype=torch.int64),
    }
    assert not dest["t"].is_contiguous() and not dest["step"].is_contiguous()
    ckptio.load(ckpt_dir, dest)
    for key, want in originals.items():
        assert bits_equal(dest[key], want), key


# --------------------------------------------------------------------------------------------
# shared storage


def test_tied_tensor_is_written_once_and_stays_tied(ckpt_dir, small_options):
    w = torch.randn(64, 32)
    state = {"a": w, "b": w, "nested": {"c": w}, "other": torch.randn(3)}
    result = ckptio.save(state, ckpt_dir, options=small_options)
    assert result.nbytes == (64 * 32 + 3) * 4, "a tied tensor was written more than once"

    fresh = ckptio.load(ckpt_dir)
    assert fresh["a"] is fresh["b"] and fresh["a"] is fresh["nested"]["c"]
    assert bits_equal(fresh["a"], w)

    shared = torch.zeros(64, 32)
    dest = {"a": shared, "b": shared, "nested": {"c": shared}, "other": torch.zeros(3)}
    ckptio.load(ckpt_dir, dest)
    assert bits_equal(shared, w) and bits_equal(dest["other"], state["other"])

    untied = {"a": torch.zeros(64, 32), "b": torch.zeros(64, 32), "nested": {"c": torch.zeros(64, 32)},
              "other": torch.zeros(3)}
    ckptio.load(ckpt_dir, untied)
    for t in (untied["a"], untied["b"], untied["nested"]["c"]):
        assert bits_equal(t, w)


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 50, bias=False)
        self.out.weight = self.emb.weight


def test_module_with_tied_weights(ckpt_dir, small_options):
    torch.manual_seed(0)
    model = TiedNet()
    result = ckptio.save({"model": model}, ckpt_dir, options=small_options)
    assert result.nbytes == (50 * 16 + 16 * 16 + 16) * 4

    fresh = ckptio.load(ckpt_dir)["model"]
    assert fresh["emb.weight"] is fresh["out.weight"]
    for key, value in model.state_dict().items():
        assert bits_equal(fresh[key], value), key

    torch.manual_seed(1)
    other = TiedNet()
    ckptio.load(ckpt_dir, {"model": other})
    assert other.out.weight is other.emb.weight
    for key, value in model.state_dict().items():
        assert bits_equal(other.state_dict()[key], value), key


def test_thousands_of_small_tensors_next_to_a_large_one(ckpt_dir, small_options):
    g = torch.Generator().manual_seed(3)
    small = {}
    for i in range(3000):
        kind = i % 4
        if kind == 0:
            small[f"p{i}"] = torch.randn(3, generator=g)
        elif kind == 1:
            small[f"p{i}"] = torch.randint(-9, 9, (2, 2), generator=g)
        elif kind == 2:
            small[f"p{i}"] = torch.randint(0, 2, (5,), generator=g).bool()
        else:
            small[f"p{i}"] = torch.randn(1, dtype=torch.complex64, generator=g)
    state = {"small": small, "big": torch.randn(800, 1000, generator=g)}
    result = ckptio.save(state, ckpt_dir, options=small_options)
    assert len(result.files) == 1, "small tensors should be packed into one data file"

    fresh = ckptio.load(ckpt_dir)
    assert bits_equal(fresh["big"], state["big"])
    assert list(fresh["small"]) == list(small)
    for key, want in small.items():
        assert bits_equal(fresh["small"][key], want), key

    dest = {"small": {k: torch.zeros_like(v) for k, v in small.items()}, "big": torch.zeros(800, 1000)}
    ckptio.load(ckpt_dir, dest)
    assert bits_equal(dest["big"], state["big"])
    assert all(bits_equal(dest["small"][k], v) for k, v in small.items())


# --------------------------------------------------------------------------------------------
# Python leaves


def test_python_leaves_round_trip_exactly(ckpt_dir, small_options, assert_same):
    state = {
        "none": None, "true": True, "false": False, "zero": 0, "one": 1, "neg": -5,
        "big": 2**64 + 1, "huge": -(10**1000),
        "float": 0.1, "negzero": -0.0, "nan": float("nan"), "inf": float("inf"),
        "ninf": float("-inf"), "tiny": 5e-324, "max": sys.float_info.max,
        "complex": complex(1.5, -0.0), "complex_nan": complex(float("nan"), float("-inf")),
        "empty_str": "", "unicode": "héllo wörld 😀 \u0000 \ud7ff \u2028 ünï", "surrogate": "\ud800x",
        "empty_bytes": b"", "bytes": bytes(range(256)) * 3,
        "nested": {"l": [1, (2.5, "x", [None, {"deep": (b"z", 3j)}])],
                   "empty_l": [], "empty_t": (), "empty_d": {}},
        "size": torch.Size([2, 3]), "size0": torch.Size([]),
        "dtype": torch.bfloat16, "dtype8": torch.float8_e5m2, "device": torch.device("cpu"),
        "int_keys": {1: "one", 2: {3: "three"}}, "str_keys": {"1": "one", "2": {"3": "three"}},
        7: "an int key at the top", "a.b": "a dotted key",
        "tuple_root": (1, 2.0, "3"),
    }
    ckptio.save(state, ckpt_dir, options=small_options)
    fresh = ckptio.load(ckpt_dir)
    assert_same(fresh, state)
    assert type(fresh["true"]) is bool and type(fresh["one"]) is int
    assert 1 in fresh["int_keys"] and "1" not in fresh["int_keys"]
    assert "1" in fresh["str_keys"] and 1 not in fresh["str_keys"]


def test_root_list_tuple_and_empty_states(tmp_path, small_options, assert_same):
    for i, state in enumerate([[torch.ones(2), 3, "x"], (torch.zeros(1), (4,)), {}, [], ()]):
        path = tmp_path / f"c{i}"
        ckptio.save(state, path, options=small_options)
        assert_same(ckptio.load(path), state)


def test_int_and_str_key_with_same_text_do_not_silently_merge(ckpt_dir, small_options, assert_same):
    state = {0: torch.ones(2), "0": torch.zeros(2)}
    try:
        ckptio.save(state, ckpt_dir, options=small_options)
    except UnsupportedStateError as exc:
        assert "0" in str(exc)
        return
    assert_same(ckptio.load(ckpt_dir), state)


def test_dotted_key_colliding_with_nested_key_is_refused(ckpt_dir, small_options):
    with pytest.raises(UnsupportedStateError, match="a.b"):
        ckptio.save({"a.b": 1, "a": {"b": 2}}, ckpt_dir, options=small_options)


def test_numpy_arrays_round_trip(ckpt_dir, small_options, assert_same):
    rng = np.random.default_rng(0)
    state = {
        "f16": rng.standard_normal(10).astype(np.float16),
        "f64": rng.standard_normal((3, 4)),
        "i32": rng.integers(-1000, 1000, (5, 2), dtype=np.int32),
        "u16": rng.integers(0, 65535, 7, dtype=np.uint16),
        "bool": rng.integers(0, 2, 9).astype(bool),
        "c64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
        "fortran": np.asfortranarray(rng.standard_normal((6, 5)).astype(np.float32)),
        "strided": rng.standard_normal(40)[::3],
        "empty": np.zeros((0, 4), dtype=np.int8),
        "big": rng.standard_normal(300_000).astype(np.float32),  # 1.2 MB: crosses a buffer
    }
    ckptio.save(state, ckpt_dir, options=small_options)
    fresh = ckptio.load(ckpt_dir)
    for key, want in state.items():
        got = fresh[key]
        assert isinstance(got, np.ndarray), key
        assert got.dtype == want.dtype and got.shape == want.shape, key
        np.testing.assert_array_equal(got, want)
        assert got.tobytes() == want.tobytes(), key

    dest = {k: np.zeros_like(v) for k, v in state.items()}
    arrays = dict(dest)
    ckptio.load(ckpt_dir, dest)
    for key, want in state.items():
        assert dest[key] is arrays[key], f"{key}: array replaced instead of filled"
        assert dest[key].tobytes() == want.tobytes(), key


def test_numpy_scalars_round_trip(ckpt_dir, small_options, assert_same):
    state = {"f32": np.float32(1.5), "i64": np.int64(-3), "b": np.bool_(True),
             "c128": np.complex128(1 + 2j), "u8": np.uint8(200)}
    ckptio.save(state, ckpt_dir, options=small_options)
    assert_same(ckptio.load(ckpt_dir), state)


def test_zero_dim_numpy_array_round_trips(ckpt_dir, small_options):
    state = {"a": np.array(2.5), "b": np.array(7, dtype=np.int16)}
    ckptio.save(state, ckpt_dir, options=small_options)
    fresh = ckptio.load(ckpt_dir)
    for key, want in state.items():
        assert fresh[key].shape == () and fresh[key].dtype == want.dtype
        assert fresh[key].tobytes() == want.tobytes()


def test_python_float_nan_sign_and_payload_are_bit_exact(ckpt_dir, small_options):
    patterns = [0xFFF8000000000000, 0x7FF8000000000001, 0x7FF4000000000000]
    state = {"f": [bits_float(b) for b in patterns],
             "c": complex(bits_float(patterns[0]), bits_float(patterns[1]))}
    ckptio.save(state, ckpt_dir, options=small_options)
    fresh = ckptio.load(ckpt_dir)
    assert [float_bits(x) for x in fresh["f"]] == patterns
    assert float_bits(fresh["c"].real) == patterns[0]
    assert float_bits(fresh["c"].imag) == patterns[1]


def test_int_past_python_str_digit_limit_round_trips_or_is_refused_cleanly(ckpt_dir, small_options):
    state = {"t": torch.ones(3), "n": 10**5000 + 1}
    try:
        ckptio.save(state, ckpt_dir, options=small_options)
    except UnsupportedStateError as exc:
        assert "n" in str(exc)
        assert not [n for n in os.listdir(ckpt_dir) if n.startswith("data-")] \
            if os.path.isdir(ckpt_dir) else True
        return
    assert ckptio.load(ckpt_dir)["n"] == 10**5000 + 1


# --------------------------------------------------------------------------------------------
# Stateful objects, models and optimizers


class Counter:
    """A minimal Stateful: anything with state_dict and load_state_dict."""

    def __init__(self, n=0, hist=None):
        self.n = n
        self.hist = torch.zeros(4) if hist is None else hist
        self.loaded_with = None

    def state_dict(self):
        return {"n": self.n, "hist": self.hist}

    def load_state_dict(self, sd):
        self.loaded_with = dict(sd)
        self.n = sd["n"]
        self.hist = sd["hist"]


def test_custom_stateful_loads_in_place(ckpt_dir, small_options):
    saved = Counter(41, torch.arange(4.0))
    ckptio.save({"counter": saved, "extra": [saved]}, ckpt_dir, options=small_options)

    target = Counter()
    target2 = Counter()
    hist = target.hist
    ckptio.load(ckpt_dir, {"counter": target, "extra": [target2]})
    assert target.n == 41 and target2.n == 41
    assert target.loaded_with is not None and target.loaded_with["n"] == 41
    assert target.hist is hist and torch.equal(hist, torch.arange(4.0))

    fresh = ckptio.load(ckpt_dir)
    assert fresh["counter"]["n"] == 41 and torch.equal(fresh["counter"]["hist"], torch.arange(4.0))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _trained(seed: int):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = torch.randn(32, 20), torch.randn(32, 5)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _step(model, opt, seed=123):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 20, generator=g), torch.randn(32, 5, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_model_and_adamw_round_trip_fresh_and_in_place(ckpt_dir, small_options, assert_same):
    model, opt = _trained(0)
    assert opt.state_dict()["state"], "the optimizer should hold state after a step"
    ckptio.save({"model": model, "opt": opt, "step": 7}, ckpt_dir, options=small_options)

    fresh = ckptio.load(ckpt_dir)
    assert fresh["step"] == 7
    assert_same(fresh["model"], dict(model.state_dict()))
    assert_same(fresh["opt"], opt.state_dict())
    assert 0 in fresh["opt"]["state"], "optimizer state keys must stay ints"

    model2, opt2 = _trained(1)
    assert not torch.equal(model2.fc1.weight, model.fc1.weight)
    state = {"model": model2, "opt": opt2, "step": 0}
    report = ckptio.load(ckpt_dir, state)
    assert state["step"] == 7
    assert "model.fc1.weight" in report.loaded and "step" in report.loaded
    assert_same(dict(model2.state_dict()), dict(model.state_dict()))
    assert_same(opt2.state_dict(), opt.state_dict())

    # the restored optimizer continues exactly like the original
    _step(model, opt)
    _step(model2, opt2)
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert bits_equal(p.detach(), p2.detach()), name


def test_in_place_load_updates_python_values_in_containers(ckpt_dir, small_options):
    saved = {"step": 7, "lr": 0.25, "name": "run-α", "flag": True, "maybe": None,
             "lst": [3, "x", 2.5], "blob": b"\x01\x02", "arr": np.arange(4.0),
             "t": torch.arange(3.0), "cfg": {"depth": 12}}
    ckptio.save(saved, ckpt_dir, options=small_options)

    arr, t = np.zeros(4), torch.zeros(3)
    state = {"step": 0, "lr": 0.0, "name": "", "flag": False, "maybe": 1,
             "lst": [0, "", 0.0], "blob": b"", "arr": arr, "t": t, "cfg": {"depth": 0}}
    ckptio.load(ckpt_dir, state)
    assert state["step"] == 7 and state["lr"] == 0.25 and state["name"] == "run-α"
    assert state["flag"] is True and state["maybe"] is None
    assert state["lst"] == [3, "x", 2.5] and state["blob"] == b"\x01\x02"
    assert state["cfg"] == {"depth": 12}
    assert state["arr"] is arr and arr.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert state["t"] is t and t.tolist() == [0.0, 1.0, 2.0]


def test_in_place_load_with_bytes_in_a_tuple(ckpt_dir, small_options):
    saved = {"t": (b"ab", 1, torch.ones(2)), "step": 3}
    ckptio.save(saved, ckpt_dir, options=small_options)
    # into the very state it saved (once refused: bytes inside a tuple)
    report = ckptio.load(ckpt_dir, saved)
    assert sorted(report.loaded) == ["step", "t.0", "t.1", "t.2"]
    # into a state holding other values: every one of them comes from the checkpoint
    tensor = torch.zeros(2)
    state = {"t": (b"", 0, tensor), "step": 0}
    report = ckptio.load(ckpt_dir, state)
    assert sorted(report.loaded) == ["step", "t.0", "t.1", "t.2"]
    assert state["step"] == 3 and state["t"][:2] == (b"ab", 1)
    assert state["t"][2] is tensor and bits_equal(tensor, torch.ones(2))  # filled in place


def test_mutation_after_save_does_not_reach_the_checkpoint(ckpt_dir, small_options):
    t = torch.randn(600, 700)  # larger than one staging buffer
    arr = np.arange(10.0)
    before_t, before_arr = t.clone(), arr.copy()
    ckptio.save({"t": t, "arr": arr, "tt": t.t()}, ckpt_dir, options=small_options)
    t.add_(1.0)
    arr += 1
    fresh = ckptio.load(ckpt_dir)
    assert bits_equal(fresh["t"], before_t)
    assert bits_equal(fresh["tt"], before_t.t())
    assert fresh["arr"].tobytes() == before_arr.tobytes()


def test_saving_twice_into_one_path_keeps_only_the_second(ckpt_dir, small_options, assert_same):
    first = {"a": torch.randn(500, 600), "x": 1}
    second = {"b": torch.randn(10), "y": "two"}
    ck = ckptio.Checkpointer(small_options)
    try:
        r1 = ck.save(first, ckpt_dir)
        r2 = ck.save(second, ckpt_dir)
        assert_same(ck.load(ckpt_dir), second)
    finally:
        ck.close()  # waits for the removal of superseded files
    assert not set(r1.files) & set(r2.files)
    assert set(os.listdir(ckpt_dir)) == {manifest.MANIFEST_NAME, *r2.files}
    assert_same(ckptio.load(ckpt_dir), second)

    # and through the module-level functions
    ckptio.save(first, ckpt_dir, options=small_options)
    assert_same(ckptio.load(ckpt_dir), first)


# --------------------------------------------------------------------------------------------
# key matching, filters and mismatches


def _saved_mixed(path, options):
    state = {"a": torch.arange(4.0), "b": torch.ones(2), "obj": 5}
    ckptio.save(state, path, options=options)
    return state


def test_strict_load_names_missing_and_unexpected_keys(ckpt_dir, small_options):
    _saved_mixed(ckpt_dir, small_options)
    dest = {"a": torch.zeros(4), "c": torch.zeros(3)}
    with pytest.raises(StateMismatchError) as info:
        ckptio.load(ckpt_dir, dest)
    message = str(info.value)
    for key in ("'b'", "'obj'", "'c'"):
        assert key in message
    assert torch.equal(dest["a"], torch.zeros(4)), "a failed strict load must not write anything"


def test_non_strict_load_reports_missing_and_unexpected(ckpt_dir, small_options):
    _saved_mixed(ckpt_dir, small_options)
    dest = {"a": torch.zeros(4), "c": torch.zeros(3)}
    report = ckptio.load(ckpt_dir, dest, strict=False)
    assert isinstance(report, ckptio.LoadReport)
    assert report.loaded == ("a",)
    assert report.missing == ("c",)
    assert sorted(report.unexpected) == ["b", "obj"]
    assert torch.equal(dest["a"], torch.arange(4.0))
    assert torch.equal(dest["c"], torch.zeros(3))


def test_a_non_strict_load_into_an_empty_container_warns_that_it_filled_nothing(
        ckpt_dir, small_options):
    """An empty dict or defaultdict(list) holds no key to fill in place: strict=False loads
    nothing, and says so (a warning pointing at the caller's line); a state sharing one key
    does not warn."""
    import collections

    _saved_mixed(ckpt_dir, small_options)
    for empty in ({}, collections.defaultdict(list)):
        with pytest.warns(UserWarning, match=r"strict=False: the state holds none of the "
                          r"checkpoint's 3 keys .*nothing was loaded") as caught:
            report = ckptio.load(ckpt_dir, empty, strict=False)
        assert report.loaded == () and not empty and caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckptio.load(ckpt_dir, {"a": torch.zeros(4)}, strict=False)


def test_a_bytearray_comes_back_a_bytearray_through_every_path(tmp_path, small_options):
    """A bytearray leaf, and one inside a tuple (an inline value), load as bytearray and a
    bytes leaf as bytes: fresh, in place, through DcpWriter, from a DCP checkpoint and
    through DcpReader (DCP itself keeps bytearray)."""
    import torch.distributed.checkpoint as dcp

    from ckptio.dcp import DcpReader, DcpWriter

    def state():
        return {"b": bytearray(b"\x00\xffab"), "y": b"xy", "t": (bytearray(b"q"), 1),
                "w": torch.ones(2)}

    def kinds(loaded):
        return type(loaded["b"]), type(loaded["y"]), type(loaded["t"][0])

    want = (bytearray, bytes, bytearray)
    ckptio.save(state(), tmp_path / "own", options=small_options)
    assert kinds(ckptio.load(tmp_path / "own")) == want
    dest = {"b": None, "y": None, "t": (None, None), "w": torch.zeros(2)}
    ckptio.load(tmp_path / "own", dest)
    assert kinds(dest) == want and dest["b"] == bytearray(b"\x00\xffab")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, one process assumed
        dcp.save(state(), storage_writer=DcpWriter(str(tmp_path / "via-writer")))
        dcp.save(state(), checkpoint_id=str(tmp_path / "dcp"))
        back = {"b": None, "y": None, "w": torch.zeros(2)}
        dcp.load(back, storage_reader=DcpReader(str(tmp_path / "own")))
    assert kinds(ckptio.load(tmp_path / "via-writer")) == want
    assert kinds(ckptio.load(tmp_path / "dcp")) == want
    assert (type(back["b"]), type(back["y"])) == (bytearray, bytes)


def _saved_tree(path, options):
    state = {"model": {"w": torch.randn(3, 2), "b": torch.randn(2)},
             "mod": {"x": torch.randn(4)}, "opt": {"lr": 0.1}, "step": 5}
    ckptio.save(state, path, options=options)
    return state


def _dest_tree():
    return {"model": {"w": torch.zeros(3, 2), "b": torch.zeros(2)},
            "mod": {"x": torch.zeros(4)}, "opt": {"lr": 0.0}, "step": 0}


def test_keys_prefix_string(ckpt_dir, small_options):
    saved = _saved_tree(ckpt_dir, small_options)
    fresh = ckptio.load(ckpt_dir, keys="model")
    assert set(fresh["model"]) == {"w", "b"}
    assert torch.equal(fresh["model"]["w"], saved["model"]["w"])
    assert "step" not in fresh
    assert not fresh.get("mod") and not fresh.get("opt"), "'mod' is not a prefix of model.*"

    dest = _dest_tree()
    report = ckptio.load(ckpt_dir, dest, keys="model")
    assert sorted(report.loaded) == ["model.b", "model.w"]
    assert torch.equal(dest["model"]["w"], saved["model"]["w"])
    assert torch.equal(dest["model"]["b"], saved["model"]["b"])
    assert torch.equal(dest["mod"]["x"], torch.zeros(4)) and dest["step"] == 0
    assert dest["opt"]["lr"] == 0.0

    only_mod = ckptio.load(ckpt_dir, keys="mod")
    assert not only_mod.get("model"), "prefix 'mod' must match whole dotted parts only"
    assert torch.equal(only_mod["mod"]["x"], saved["mod"]["x"])


def test_keys_list_and_callable(ckpt_dir, small_options):
    saved = _saved_tree(ckpt_dir, small_options)
    dest = _dest_tree()
    report = ckptio.load(ckpt_dir, dest, keys=["mod", "step", "opt.lr"])
    assert sorted(report.loaded) == ["mod.x", "opt.lr", "step"]
    assert dest["step"] == 5 and dest["opt"]["lr"] == 0.1
    assert torch.equal(dest["mod"]["x"], saved["mod"]["x"])
    assert torch.equal(dest["model"]["w"], torch.zeros(3, 2))

    dest = _dest_tree()
    report = ckptio.load(ckpt_dir, dest, keys=lambda k: k.endswith(".b"))
    assert report.loaded == ("model.b",)
    assert torch.equal(dest["model"]["b"], saved["model"]["b"])
    assert torch.equal(dest["model"]["w"], torch.zeros(3, 2))

    fresh = ckptio.load(ckpt_dir, keys=lambda k: k == "step")
    assert fresh == {"step": 5}  # no skeletons of the containers left out (issue 50)
    fresh = ckptio.load(ckpt_dir, keys=["model.b", "opt"])
    assert list(fresh) == ["model", "opt"] and list(fresh["model"]) == ["b"]
    assert torch.equal(fresh["model"]["b"], saved["model"]["b"]) and fresh["opt"]["lr"] == 0.1


def test_dtype_mismatch_is_an_error_unless_cast(ckpt_dir, small_options):
    w = torch.randn(5, 3)
    ckptio.save({"layer": {"w": w}, "i": torch.arange(4, dtype=torch.int32)}, ckpt_dir,
                options=small_options)
    dest = {"layer": {"w": torch.zeros(5, 3, dtype=torch.float64)}, "i": torch.zeros(4, dtype=torch.int64)}
    with pytest.raises(StateMismatchError, match=r"layer\.w"):
        ckptio.load(ckpt_dir, dest)
    assert torch.equal(dest["layer"]["w"], torch.zeros(5, 3, dtype=torch.float64))

    ckptio.load(ckpt_dir, dest, cast=True)
    assert dest["layer"]["w"].dtype == torch.float64
    assert torch.equal(dest["layer"]["w"], w.to(torch.float64))
    assert torch.equal(dest["i"], torch.arange(4, dtype=torch.int64))

    bf = {"layer": {"w": torch.zeros(5, 3, dtype=torch.bfloat16)}, "i": torch.zeros(4, dtype=torch.int32)}
    ckptio.load(ckpt_dir, bf, cast=True)
    assert torch.equal(bf["layer"]["w"], w.to(torch.bfloat16))


def test_shape_mismatch_is_always_an_error(ckpt_dir, small_options):
    ckptio.save({"w": torch.randn(5, 3)}, ckpt_dir, options=small_options)
    for cast in (False, True):
        dest = {"w": torch.zeros(3, 5)}
        with pytest.raises(StateMismatchError, match="w"):
            ckptio.load(ckpt_dir, dest, cast=cast)
        assert torch.equal(dest["w"], torch.zeros(3, 5))


def test_non_strict_load_skips_and_reports_mismatched_keys(ckpt_dir, small_options):
    w, b = torch.randn(5, 3), torch.randn(3)
    ckptio.save({"head": {"w": w, "b": b}, "step": 7}, ckpt_dir, options=small_options)
    # a new head of another shape and dtype: fine-tuning loads what fits and says what did not
    dest = {"head": {"w": torch.zeros(9, 3), "b": torch.zeros(3, dtype=torch.float16)}, "step": 0}
    with pytest.warns(UserWarning, match=r"strict=False: 2 key\(s\) left as they were, their "
                      r"dtype or shape differs .*: head\.w: .*LoadReport\.mismatched") as said:
        report = ckptio.load(ckpt_dir, dest, strict=False)
    assert said[0].filename == __file__  # pointing at the caller's line
    assert set(report.loaded) == {"step"}
    assert len(report.mismatched) == 2
    assert any(m.startswith("head.w:") and "shape" in m for m in report.mismatched)
    assert any(m.startswith("head.b:") and "dtype" in m for m in report.mismatched)
    assert torch.equal(dest["head"]["w"], torch.zeros(9, 3))  # skipped, untouched
    assert dest["step"] == 7
    with pytest.raises(StateMismatchError, match=r"head\.w.*strict=False"):
        ckptio.load(ckpt_dir, dest)


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-optimizer", "stepped-optimizer"])
def test_non_strict_load_into_a_resized_model_leaves_its_optimizer_state_out(ckpt_dir, fresh):
    """A layer resized since the save: its saved Adam moments have the old shape. Loaded into
    the optimizer, its next step failed (a fresh one) or mixed shapes; they are left out and
    listed, and the parameters that kept their shape get their state."""
    def build(hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Linear(hidden, 1))
        return model, torch.optim.AdamW(model.parameters())

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        model(torch.randn(3, 8)).sum().backward()
        opt.step()

    model, opt = build(32)
    step(model, opt)
    ckptio.save({"model": model, "optim": opt}, ckpt_dir)
    model2, opt2 = build(48)
    if not fresh:
        step(model2, opt2)
    mine = {p: {k: v.clone() for k, v in st.items()} for p, st in opt2.state.items()}
    with pytest.warns(UserWarning, match="resized parameter's optimizer state"):
        report = ckptio.load(ckpt_dir, {"model": model2, "optim": opt2}, strict=False)
    left = {m.split(":")[0] for m in report.mismatched if "optimizer state" in m}
    assert left == {f"optim.state.{i}.{k}" for i in (0, 1, 2) for k in ("step", "exp_avg",
                                                                        "exp_avg_sq")}
    bias = opt2.state[model2[1].bias]  # shape (1,) both times: its state is the checkpoint's
    assert torch.equal(bias["exp_avg"], opt.state[model[1].bias]["exp_avg"])
    for p in list(model2.parameters())[:3]:  # as they were (no state, or their own)
        assert (p in mine) == (p in opt2.state) == (not fresh)
        assert all(torch.equal(opt2.state[p][k], v) for k, v in mine.get(p, {}).items())
    step(model2, opt2)  # the next step runs


# --------------------------------------------------------------------------------------------
# unsupported leaves and pickle


@pytest.mark.parametrize("bad", [{1, 2}, Point(1, 2), object(), frozenset({3})],
                         ids=["set", "custom", "object", "frozenset"])
def test_unsupported_leaf_is_refused_at_save_naming_the_key(bad, ckpt_dir, small_options):
    with pytest.raises(UnsupportedStateError, match=r"outer\.bad"):
        ckptio.save({"ok": torch.ones(2), "outer": {"bad": bad}}, ckpt_dir, options=small_options)
    with pytest.raises((CheckpointNotFoundError, IncompleteCheckpointError)):
        ckptio.load(ckpt_dir)


def test_pickle_opt_in_on_save_and_on_load(ckpt_dir, small_options):
    t = torch.randn(4)
    ckptio.save({"s": {1, 2, 3}, "p": Point(1, "y"), "t": t}, ckpt_dir, allow_pickle=True,
                options=small_options)

    with pytest.raises(PickleRefusedError) as info:
        ckptio.load(ckpt_dir)
    assert "'p'" in str(info.value) and "'s'" in str(info.value)

    dest = {"s": None, "p": None, "t": torch.zeros(4)}
    with pytest.raises(PickleRefusedError, match="'p'"):
        ckptio.load(ckpt_dir, dest)
    assert dest["p"] is None and torch.equal(dest["t"], torch.zeros(4))

    only_t = ckptio.load(ckpt_dir, keys="t")  # pickled keys filtered out: no opt-in needed
    assert torch.equal(only_t["t"], t) and "p" not in only_t

    fresh = ckptio.load(ckpt_dir, allow_pickle=True)
    assert fresh["s"] == {1, 2, 3} and fresh["p"] == Point(1, "y")
    ckptio.load(ckpt_dir, dest, allow_pickle=True)
    assert dest["s"] == {1, 2, 3} and dest["p"] == Point(1, "y") and torch.equal(dest["t"], t)


def test_a_value_pickle_cannot_store_is_a_ckpterror_naming_the_key(ckpt_dir, small_options):
    """allow_pickle=True with a lambda (and a lock): UnsupportedStateError naming the key and
    the fix, not pickle's own error from inside ckptio; the committed checkpoint stays."""
    import threading

    ckptio.save({"t": torch.ones(2)}, ckpt_dir, options=small_options)
    for bad in (lambda x: x, threading.Lock()):
        with pytest.raises(UnsupportedStateError, match=r"key 'cfg\.fn': allow_pickle=True, but "
                           r"this .* cannot be pickled .*leave it out of the state"):
            ckptio.save({"t": torch.zeros(2), "cfg": {"fn": bad}}, ckpt_dir, allow_pickle=True,
                        options=small_options)
    assert torch.equal(ckptio.load(ckpt_dir)["t"], torch.ones(2))


# --------------------------------------------------------------------------------------------
# verification, file splitting, errors


def test_verify_false_skips_checksums_and_verify_detects_corruption(ckpt_dir, small_options):
    w = torch.randn(300, 1000)  # 1.2 MB: spans two reads
    ckptio.save({"w": w, "v": torch.arange(10)}, ckpt_dir, options=small_options)
    assert bits_equal(ckptio.load(ckpt_dir, verify=False)["w"], w)

    entry = next(e for e in read_manifest(ckpt_dir).tensors if e.key == "w")
    corrupt_at = entry.offset + entry.nbytes - 5  # in the last read of the entry
    with open(os.path.join(ckpt_dir, entry.file), "r+b") as f:
        f.seek(corrupt_at)
        byte = f.read(1)
        f.seek(corrupt_at)
        f.write(bytes([byte[0] ^ 0xFF]))

    with pytest.raises(CorruptCheckpointError, match="'w'"):
        ckptio.load(ckpt_dir)
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        ckptio.verify(ckpt_dir)
    got = ckptio.load(ckpt_dir, verify=False)["w"]
    diff = (raw(got) != raw(w)).nonzero().flatten().tolist()
    assert diff == [w.numel() * 4 - 5]
    assert torch.equal(ckptio.load(ckpt_dir, keys="v")["v"], torch.arange(10))


def test_small_max_file_bytes_splits_into_several_files(ckpt_dir, small_options):
    import dataclasses

    options = dataclasses.replace(small_options, max_file_bytes=1 * MiB)
    state = {f"t{i}": torch.randn(75_000) for i in range(10)}  # 300 KB each
    state["big"] = torch.randn(1500, 500).t()  # 3 MB, more than a whole file
    state["tail"] = torch.arange(3)
    result = ckptio.save(state, ckpt_dir, options=options)
    assert len(result.files) >= 5
    record = read_manifest(ckpt_dir)
    by_file: dict[str, list] = {}
    for e in record.tensors:
        by_file.setdefault(e.file, []).append(e)
    assert set(by_file) == set(result.files)
    for name, entries in by_file.items():
        if len(entries) > 1:
            assert max(e.offset + e.nbytes for e in entries) <= options.max_file_bytes, name
    fresh = ckptio.load(ckpt_dir)
    for key, want in state.items():
        assert bits_equal(fresh[key], want), key


def test_verify_returns_the_byte_count(ckpt_dir, small_options):
    state = {"a": torch.randn(700, 900), "b": torch.arange(10), "c": 3}
    result = ckptio.save(state, ckpt_dir, options=small_options)
    n = ckptio.verify(ckpt_dir)
    assert result.nbytes == 700 * 900 * 4 + 10 * 8  # float32 + int64
    assert result.nbytes <= n <= data_bytes(ckpt_dir)
    assert n % 4096 == 0

    empty = ckpt_dir.parent / "empty"
    ckptio.save({"x": 1}, empty, options=small_options)
    assert ckptio.verify(empty) == 0


def test_missing_and_incomplete_checkpoints_raise(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        ckptio.load(tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "data-0000000000000000000-r00000-0000.bin").write_bytes(b"\0" * 10)
    with pytest.raises(IncompleteCheckpointError):
        ckptio.load(tmp_path / "half")
    assert issubclass(IncompleteCheckpointError, CkptError)


def test_a_mistyped_path_names_what_is_near(tmp_path, small_options):
    """A step that is not there names the nearest steps beside it; a mistyped directory the
    names spelled alike; a path far from anything just says it does not exist."""
    mgr = ckptio.CheckpointManager(tmp_path / "run", options=small_options)
    for step in (10, 20, 30):
        mgr.save(step, {"w": torch.ones(2)})
    mgr.close()
    with pytest.raises(CheckpointNotFoundError, match=r"step-25: the path does not exist; its "
                       r"directory holds 3 step\(s\), step-10 to step-30; nearest: step-20, "
                       r"step-30$"):
        ckptio.load(tmp_path / "run" / "step-25")
    with pytest.raises(CheckpointNotFoundError, match=r"rnu: the path does not exist; did you "
                       r"mean run\?$"):
        ckptio.load(tmp_path / "rnu")
    with pytest.raises(CheckpointNotFoundError, match=r"elsewhere: the path does not exist$"):
        ckptio.load(tmp_path / "elsewhere")
    # a step of a mistyped run directory: the name of the run it may mean
    with pytest.raises(CheckpointNotFoundError, match=r"rnu/step-20: the path does not exist; "
                       r"rnu: did you mean run\?$"):
        ckptio.load(tmp_path / "rnu" / "step-20")
