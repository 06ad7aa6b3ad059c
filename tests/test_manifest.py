"""manifest.py alone: encode/decode round trip, and hostile manifests rejected with ManifestError."""

from __future__ import annotations

import dataclasses
import json
import zlib

import pytest

from ckptio.format import manifest
from ckptio.errors import CorruptCheckpointError, ManifestError
from ckptio.format.types import Chunk, FileInfo, Manifest, ObjectEntry, TensorEntry

WHERE = "/ckpts/step-9/manifest.json"
F0 = "data-0123456789abcdef0123-r00000-0000.bin"
F1 = "data-0123456789abcdef0123-r00000-0001.bin"


def entry(key, dtype, shape, file, offset, nbytes, kind="tensor"):
    return TensorEntry(key, kind, dtype, tuple(shape), Chunk.whole(tuple(shape)), file, offset,
                       nbytes, "0123456789abcdef")


def good_manifest() -> Manifest:
    return Manifest(
        version=manifest.VERSION,
        save_id="0123456789abcdef0123",
        checksum_algorithm="xxh3_64",
        world_size=1,
        files=(FileInfo(F0, 8192, 0), FileInfo(F1, 4096, 0)),
        tensors=(
            entry("model.w", "float32", (4, 8), F0, 0, 128),
            entry("model.b", "bfloat16", (3,), F0, 128, 6),
            entry("empty", "float64", (0, 3), F0, 4096, 0),
            entry("arr", "int16", (2, 2), F1, 0, 8, kind="numpy"),
            entry("blob", "uint8", (5,), F1, 64, 5, kind="bytes"),
        ),
        objects=(ObjectEntry("step", ["int", 7]), ObjectEntry("name", ["str", "ü"]),
                 ObjectEntry("3.x", ["float", "0x1.8p+0"])),
        aliases=(("tied", "model.w"),),
        tree={"d": [
            ["model", {"d": [["w", {"k": "model.w"}], ["b", {"k": "model.b"}]]}],
            ["empty", {"k": "empty"}], ["arr", {"k": "arr"}], ["blob", {"k": "blob"}],
            ["step", {"k": "step"}], ["name", {"k": "name"}], ["tied", {"k": "tied"}],
            [3, {"t": [{"d": [["x", {"k": "3.x"}]]}, {"l": []}]}],
        ]},
        meta={"ckptio_version": "0.1.0", "created_unix": 1.5},
    )


def split(data: bytes) -> tuple[dict, dict]:
    header, body = data.split(b"\n", 1)
    return json.loads(header), json.loads(body)


def wrap(body, *, version=manifest.VERSION) -> bytes:
    """A manifest whose header matches its body: only the body's content is under test."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    header = {"magic": manifest.MAGIC, "version": version, "body_nbytes": len(raw),
              "body_crc32": zlib.crc32(raw)}
    return json.dumps(header).encode() + b"\n" + raw + b"\n"


def good_body() -> dict:
    return split(manifest.encode(good_manifest()))[1]


def rejected(data: bytes) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        manifest.decode(data, WHERE)
    assert WHERE in str(info.value), "the error must name the manifest"
    return info.value


# --------------------------------------------------------------------------------------------
# round trip


def test_encode_decode_round_trip():
    m = good_manifest()
    data = manifest.encode(m)
    decoded = manifest.decode(data, WHERE)
    assert decoded == m
    assert manifest.encode(decoded) == data
    header, body = split(data)
    assert header["magic"] == manifest.MAGIC and header["version"] == manifest.VERSION
    assert body["format"] == "ckptio"
    assert isinstance(decoded.tensors[0].shape, tuple) and isinstance(decoded.aliases[0], tuple)


def test_wrap_helper_builds_an_accepted_manifest():
    assert manifest.decode(wrap(good_body()), WHERE) == good_manifest()


def test_empty_checkpoint_manifest_round_trips():
    m = Manifest(version=manifest.VERSION, save_id="x", checksum_algorithm="xxh3_64", world_size=1,
                 files=(), tensors=(), objects=(), aliases=(), tree={"d": []}, meta={})
    assert manifest.decode(manifest.encode(m), WHERE) == m


def test_manifest_of_a_real_save_decodes(tmp_path, small_options):
    import torch

    import ckptio

    w = torch.randn(3, 3)
    ckptio.save({"w": w, "tied": w, "n": 3, "b": b"xy"}, tmp_path / "c", options=small_options)
    path = tmp_path / "c" / manifest.MANIFEST_NAME
    m = manifest.decode(path.read_bytes(), str(path))
    assert {t.key for t in m.tensors} == {"w", "b"}
    assert m.aliases == (("tied", "w"),)
    assert [o.key for o in m.objects] == ["n"]
    assert manifest.decode(manifest.encode(m), WHERE) == m


def test_manifest_error_is_a_corrupt_checkpoint_error():
    assert issubclass(ManifestError, CorruptCheckpointError)


# --------------------------------------------------------------------------------------------
# damage to the bytes


def test_every_flipped_byte_is_detected():
    data = manifest.encode(good_manifest())
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0xFF
        with pytest.raises(ManifestError):
            manifest.decode(bytes(damaged), WHERE)


def test_flipped_bit_in_body_fails_the_crc():
    data = manifest.encode(good_manifest())
    body_start = data.index(b"\n") + 1
    i = body_start + data[body_start:].index(b'"model.w"') + 3
    damaged = bytearray(data)
    damaged[i] ^= 0x01  # 'o' -> 'n': still valid JSON, only the CRC can tell
    json.loads(bytes(damaged[body_start:]))
    assert "CRC" in str(rejected(bytes(damaged)))


def test_every_truncation_is_detected():
    data = manifest.encode(good_manifest())
    for cut in range(len(data) - 1):  # cutting only the final newline leaves it whole
        with pytest.raises(ManifestError):
            manifest.decode(data[:cut], WHERE)


@pytest.mark.parametrize("data", [
    b"", b"\n", b"{}\n{}", b"not json\n{}", b"\xff\xfe\x00\n{}", b"[1, 2]\n{}",
    json.dumps({"magic": "other", "version": 1}).encode() + b"\n{}",
    b"[" * 100_000 + b"]" * 100_000 + b"\n{}",
    b'{"magic": "ckptio-manifest", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}\n{}",
], ids=["empty", "newline", "no-magic", "junk", "binary", "list", "wrong-magic", "deep",
        "deep-field"])
def test_bad_header_line(data):
    rejected(data)


def test_body_that_is_not_json():
    assert "not JSON" in str(rejected(wrap(b'{"format": "ckptio", ')))


def test_future_version_says_to_upgrade():
    body = good_body()
    body["version"] = manifest.VERSION_CODED + 1
    assert "upgrade" in str(rejected(wrap(body, version=manifest.VERSION_CODED + 1)))
    data = manifest.encode(good_manifest())
    header, rest = data.split(b"\n", 1)
    bumped = json.loads(header)
    bumped["version"] = 99
    assert "upgrade" in str(rejected(json.dumps(bumped).encode() + b"\n" + rest))


# --------------------------------------------------------------------------------------------
# a well-formed envelope around a body that lies


def _rename_file(body, old, new):
    for f in body["files"]:
        if f["name"] == old:
            f["name"] = new
    for t in body["tensors"]:
        if t["file"] == old:
            t["file"] = new


def _tensor(body, key):
    return next(t for t in body["tensors"] if t["key"] == key)


def _set(key, field, value):
    def mutate(body):
        _tensor(body, key)[field] = value
    return mutate


def _set_chunk(offsets, sizes):
    def mutate(body):
        _tensor(body, "model.w")["chunk"] = {"offsets": offsets, "sizes": sizes}
    return mutate


def _top(field, value):
    def mutate(body):
        body[field] = value
    return mutate


def _drop(field):
    def mutate(body):
        del body[field]
    return mutate


def _file_field(index, field, value):
    def mutate(body):
        body["files"][index][field] = value
    return mutate


def _name(new):
    return lambda body: _rename_file(body, F0, new)


def _tree_drop(key):
    def mutate(body):
        body["tree"]["d"] = [kv for kv in body["tree"]["d"] if kv[0] != key]
    return mutate


def _both(*mutations):
    def mutate(body):
        for m in mutations:
            m(body)
    return mutate


def _tree_add(body):
    body["tree"]["d"].append(["ghost", {"k": "ghost"}])


def _dup_tensor_key(body):
    _tensor(body, "model.b")["key"] = "model.w"


def _same_chunk_twice(body):
    body["tensors"].append(dict(_tensor(body, "model.w")))


def _both_global_and_per_rank(body):
    copy = dict(_tensor(body, "model.w"))
    copy["rank"] = 0
    body["tensors"].append(copy)


def _two_of_one_rank(body):
    _tensor(body, "model.w")["rank"] = 0
    copy = dict(_tensor(body, "model.w"))
    body["tensors"].append(copy)


def _per_rank_object_twice(body):
    body["objects"][0]["rank"] = 0
    body["objects"].append(dict(body["objects"][0]))


def _big_entry(blocks):
    def mutate(body):
        body["block_nbytes"] = 64
        _tensor(body, "model.w")["blocks"] = blocks
    return mutate


def _object_key_of_tensor(body):
    body["objects"][0]["key"] = "model.w"


def _alias_key_of_tensor(body):
    body["aliases"] = [["model.b", "model.w"]]


def _dup_file(body):
    body["files"].append(dict(body["files"][0]))


def _tensor_in_unlisted_file(body):
    body["files"] = [f for f in body["files"] if f["name"] != F1]


def _deep(body):
    return b'{"format":"ckptio","version":1,"tree":' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _nested_meta(depth):
    """The body with "meta" nested ``depth`` arrays deep (the body itself is one more)."""
    def mutate(body):
        body["meta"] = "DEEP"
        return json.dumps(body).replace('"DEEP"', "[" * depth + "]" * depth).encode()
    return mutate


def _two_chunks(first, second):
    """model.w (4 x 8 float32) as two chunks of 16 elements each, in its own bytes."""
    def mutate(body):
        w = _tensor(body, "model.w")
        w.update(first, nbytes=64)
        body["tensors"].append(dict(w, **second, offset=64, nbytes=64))
    return mutate


def _empty_shape(shape):
    return _both(_set("empty", "shape", shape),
                 lambda b: _tensor(b, "empty").__setitem__(
                     "chunk", {"offsets": [0] * len(shape), "sizes": shape}))


def _tree_dup_key(body):
    body["tree"]["d"].append(["step", {"k": "dup"}])
    body["objects"].append({"key": "dup", "value": ["int", 1]})


HOSTILE = [
    # data file names
    pytest.param(_name("../" + F0), id="name-dotdot-slash"),
    pytest.param(_name("sub/" + F0), id="name-slash"),
    pytest.param(_name("/etc/passwd"), id="name-absolute"),
    pytest.param(_name(".."), id="name-dotdot"),
    pytest.param(_name("."), id="name-dot"),
    pytest.param(_name(""), id="name-empty"),
    pytest.param(_name("a\x00b"), id="name-nul"),
    pytest.param(_name("a\\b"), id="name-backslash"),
    pytest.param(_name("x" * 300), id="name-long"),
    pytest.param(_name(5), id="name-not-str"),
    pytest.param(_dup_file, id="file-listed-twice"),
    pytest.param(_tensor_in_unlisted_file, id="tensor-in-unlisted-file"),
    pytest.param(_file_field(0, "nbytes", -1), id="file-nbytes-negative"),
    pytest.param(_file_field(0, "nbytes", 1 << 62), id="file-nbytes-huge"),
    # byte ranges
    pytest.param(_set("model.w", "offset", 8192 - 64), id="range-past-file-end"),
    pytest.param(_set("model.b", "offset", 8192), id="range-starts-at-file-end"),
    pytest.param(_set("model.w", "nbytes", 132), id="nbytes-not-shape-times-itemsize"),
    pytest.param(_both(_set("model.w", "shape", [4, 9]), _set_chunk([0, 0], [4, 9])),
                 id="shape-disagrees-with-nbytes"),
    pytest.param(_set("model.w", "offset", -64), id="offset-negative"),
    pytest.param(_set("model.w", "offset", 1 << 62), id="offset-2^62"),
    pytest.param(_set("model.w", "offset", 10**30), id="offset-huge"),
    pytest.param(_set("model.w", "nbytes", 1 << 63), id="nbytes-huge"),
    pytest.param(_set("model.w", "offset", 64.0), id="offset-float"),
    pytest.param(_set("model.w", "offset", True), id="offset-bool"),
    pytest.param(_set("model.w", "offset", "0"), id="offset-str"),
    pytest.param(_set("model.w", "shape", [-4, -8]), id="shape-negative"),
    pytest.param(_set("model.w", "shape", [1 << 62, 0]), id="shape-huge"),
    pytest.param(_set("model.w", "shape", 32), id="shape-not-list"),
    # dtype, kind, checksum
    pytest.param(_set("model.w", "dtype", "float128"), id="dtype-unknown"),
    pytest.param(_set("model.w", "dtype", "object"), id="dtype-object"),
    pytest.param(_set("model.w", "dtype", None), id="dtype-null"),
    pytest.param(_set("model.w", "kind", "exe"), id="kind-unknown"),
    pytest.param(_set("model.w", "checksum", "xyz"), id="checksum-not-hex"),
    pytest.param(_set("model.w", "checksum", "0123456789ABCDEF"), id="checksum-upper"),
    # chunks
    pytest.param(_set_chunk([1, 0], [4, 8]), id="chunk-outside-shape"),
    pytest.param(_set_chunk([0, 0, 0], [4, 8, 1]), id="chunk-rank-mismatch"),
    pytest.param(_set_chunk([0], [4]), id="chunk-rank-short"),
    pytest.param(_set_chunk([0, -1], [4, 8]), id="chunk-negative"),
    pytest.param(_set_chunk({"x": 1}, [4, 8]), id="chunk-offsets-not-list"),
    pytest.param(lambda b: _tensor(b, "model.w")["chunk"].__setitem__("flat", 1), id="chunk-flat-not-bool"),
    pytest.param(lambda b: _tensor(b, "model.w").__setitem__(
        "chunk", {"offsets": [30], "sizes": [4], "flat": True}), id="flat-chunk-past-end"),
    # many ranks
    pytest.param(_set("model.w", "rank", 1), id="rank-not-below-world-size"),
    pytest.param(_set("model.w", "rank", -1), id="rank-negative"),
    pytest.param(_both(_set("model.w", "rank", 0), _set_chunk([0, 0], [2, 8]),
                       _set("model.w", "nbytes", 64)), id="per-rank-entry-not-whole"),
    pytest.param(_both_global_and_per_rank, id="key-both-global-and-per-rank"),
    pytest.param(_two_of_one_rank, id="two-entries-of-one-rank"),
    pytest.param(_same_chunk_twice, id="same-chunk-twice"),
    pytest.param(_per_rank_object_twice, id="per-rank-object-twice"),
    pytest.param(_top("block_nbytes", 0), id="block-nbytes-zero"),
    pytest.param(_drop("block_nbytes"), id="block-nbytes-missing"),
    pytest.param(_big_entry(["0123456789abcdef"]), id="too-few-block-checksums"),
    pytest.param(_big_entry(["0123456789abcdef"] * 2 + ["xyz"]), id="block-checksum-not-hex"),
    pytest.param(_set("model.b", "blocks", ["0123456789abcdef"]), id="blocks-on-a-small-entry"),
    # keys
    pytest.param(_dup_tensor_key, id="duplicate-tensor-key"),
    pytest.param(_object_key_of_tensor, id="object-key-of-tensor"),
    pytest.param(_alias_key_of_tensor, id="alias-key-of-tensor"),
    pytest.param(_top("aliases", [["tied", "missing"]]), id="alias-to-missing-key"),
    pytest.param(_top("aliases", [["tied", "step"]]), id="alias-to-object"),
    pytest.param(_top("aliases", [["tied"]]), id="alias-malformed"),
    pytest.param(_top("aliases", [["tied", 3]]), id="alias-target-not-str"),
    pytest.param(_top("objects", [{"key": 5, "value": ["int", 1]}]), id="object-key-not-str"),
    # tree
    pytest.param(_tree_drop("step"), id="tree-misses-a-key"),
    pytest.param(_tree_add, id="tree-has-extra-key"),
    pytest.param(_top("tree", {"x": []}), id="tree-unknown-tag"),
    pytest.param(_top("tree", [1, 2]), id="tree-not-dict"),
    pytest.param(_top("tree", None), id="tree-null"),
    pytest.param(_top("tree", {"d": 5}), id="tree-dict-body-not-list"),
    pytest.param(_top("tree", {"l": 5}), id="tree-list-body-not-list"),
    pytest.param(_top("tree", {"d": [[1]]}), id="tree-dict-item-not-pair"),
    pytest.param(_top("tree", {"d": [["a", {"k": 3}], ["b", {"k": "model.w"}]]}),
                 id="tree-leaf-key-not-str"),
    pytest.param(
        lambda b: b["tree"]["d"].__setitem__(1, [["empty"], {"k": "empty"}]), id="tree-dict-key-list"),
    # top level
    pytest.param(_top("format", "other"), id="format-wrong"),
    pytest.param(_top("version", manifest.VERSION_CODED + 1), id="body-version-disagrees"),
    pytest.param(_top("world_size", -1), id="world-size-negative"),
    pytest.param(_top("checksum_algorithm", 5), id="checksum-algorithm-not-str"),
    # "none" is what ckptio's own safetensors records say; a manifest naming it would load unchecked
    pytest.param(_top("checksum_algorithm", "none"), id="checksum-algorithm-none"),
    pytest.param(_top("checksum_algorithm", "md5"), id="checksum-algorithm-unknown"),
    pytest.param(_drop("tensors"), id="missing-tensors"),
    pytest.param(_drop("tree"), id="missing-tree"),
    pytest.param(_top("tensors", {"0": {}}), id="tensors-not-list"),
    pytest.param(_top("files", [5]), id="file-not-object"),
    pytest.param(lambda b: b"[]", id="body-a-list"),
    pytest.param(lambda b: b"null", id="body-null"),
    pytest.param(lambda b: b'"ckptio"', id="body-a-string"),
    pytest.param(_deep, id="body-deeply-nested"),
]


@pytest.mark.parametrize("mutate", HOSTILE)
def test_hostile_body_is_rejected(mutate):
    body = good_body()
    result = mutate(body)
    rejected(wrap(body if result is None else result))


# issue 11: each class a load once met as another exception (TypeError, RuntimeError, ...), a
# hang or a huge allocation; each refused by its own rule, which the message names
ISSUE_11 = [
    pytest.param(_nested_meta(manifest.MAX_JSON_DEPTH), "nests deeper than", id="body-too-deep"),
    pytest.param(_set("model.w", "offset", 2), "offset 2 in data-", id="offset-not-multiple"),
    pytest.param(_set("model.b", "offset", 129), "of the 2-byte elements of bfloat16",
                 id="offset-odd-for-bfloat16"),
    pytest.param(_set("model.w", "dtype", ["float32"]), "dtype must be a string, got a list",
                 id="dtype-list-unhashable"),
    pytest.param(_set("model.w", "dtype", {"float32": 1}), "dtype must be a string",
                 id="dtype-dict-unhashable"),
    pytest.param(_set("model.w", "kind", ["tensor"]), "kind must be a string", id="kind-list"),
    pytest.param(_set("model.b", "kind", "numpy"), "'numpy' cannot hold dtype bfloat16",
                 id="bfloat16-as-numpy"),
    pytest.param(_set("model.b", "kind", "numpy_scalar"), "cannot hold dtype bfloat16",
                 id="bfloat16-as-numpy-scalar"),
    pytest.param(_set("model.w", "kind", "numpy_scalar"), "with shape (), not (4, 8)",
                 id="numpy-scalar-not-0d"),
    pytest.param(_set("model.w", "kind", "bytes"), "stored as 1-D uint8, not float32",
                 id="float32-as-bytes"),
    pytest.param(_set("arr", "kind", "pickle"), "stored as 1-D uint8, not int16",
                 id="int16-2d-as-pickle"),
    pytest.param(_both(_set("model.w", "shape", [1 << 40]), _set_chunk([0], [32])),
                 "hold 32 of the 1099511627776 elements", id="shape-far-larger-than-its-chunk"),
    pytest.param(_both(_set_chunk([0, 0], [2, 8]), _set("model.w", "nbytes", 64)),
                 "hold 16 of the 32 elements", id="chunks-miss-part-of-the-tensor"),
    pytest.param(_two_chunks({"chunk": {"offsets": [0, 0], "sizes": [2, 8]}},
                             {"chunk": {"offsets": [1, 0], "sizes": [2, 8]}}),
                 "chunks overlap at index 1 of dimension 0", id="chunks-overlap-and-leave-a-gap"),
    pytest.param(_two_chunks({"chunk": {"offsets": [0], "sizes": [16], "flat": True}},
                             {"chunk": {"offsets": [8], "sizes": [16], "flat": True}}),
                 "flat chunks overlap at element 8", id="flat-chunks-overlap"),
    pytest.param(_two_chunks({"chunk": {"offsets": [0, 0], "sizes": [4, 4]}},
                             {"chunk": {"offsets": [8], "sizes": [16], "flat": True}}),
                 "leave a gap at index 0 of dimension 0", id="box-and-flat-chunks-overlap"),
    pytest.param(_empty_shape([0] + [1] * manifest.MAX_NDIM), "more than 128",
                 id="shape-too-many-dims"),
    pytest.param(_empty_shape([2 ** 61, 2 ** 61, 0]), "too large", id="shape-overflows-strides"),
    pytest.param(_set("model.b", "offset", 64), "claim the same bytes [64, 70)",
                 id="entries-share-bytes"),
    pytest.param(_top("world_size", 0), "world_size must be at least 1", id="world-size-zero"),
    pytest.param(_file_field(0, "rank", 1), "rank 1 is not below world_size 1",
                 id="file-rank-not-below-world-size"),
    pytest.param(_tree_dup_key, "holds key 'step' twice", id="tree-dict-key-twice"),
]


@pytest.mark.parametrize("mutate,says", ISSUE_11)
def test_issue_11_class_is_refused_by_its_own_rule(mutate, says):
    body = good_body()
    result = mutate(body)
    message = str(rejected(wrap(body if result is None else result)))
    assert says in message, message
    assert "load an earlier one" in message, message


def test_nesting_up_to_the_limit_is_accepted():
    """The depth limit leaves room for the deepest state a save writes (MAX_TREE_DEPTH dict
    levels, 3 brackets each); one level more is refused (above)."""
    assert manifest.MAX_JSON_DEPTH > 3 * manifest.MAX_TREE_DEPTH + 2
    body = good_body()
    deep = _nested_meta(manifest.MAX_JSON_DEPTH - 1)(body)
    assert manifest.json_depth(deep) == manifest.MAX_JSON_DEPTH
    assert manifest.decode(wrap(deep), WHERE).tensors == good_manifest().tensors


def test_deepest_state_a_save_writes_loads(tmp_path, small_options):
    import torch

    import ckptio

    state = {"x": torch.ones(1)}
    for _ in range(manifest.MAX_TREE_DEPTH - 1):
        state = {"a": state}
    ckptio.save(state, tmp_path / "c", options=small_options)
    data = (tmp_path / "c" / manifest.MANIFEST_NAME).read_bytes()
    assert manifest.json_depth(data.split(b"\n", 1)[1]) > 3 * (manifest.MAX_TREE_DEPTH - 1)
    loaded = ckptio.load(tmp_path / "c")
    for _ in range(manifest.MAX_TREE_DEPTH - 1):
        loaded = loaded["a"]
    assert torch.equal(loaded["x"], torch.ones(1))


@pytest.mark.parametrize("value,says", [
    (["float", "nan:00"], "16 hex digits"), (["float", "nan:3ff0000000000000"], "not a NaN"),
    (["float", "0x1p99999"], "too large"), (["float", "1e5"], "not float.hex() text"),
    (["float", 1.5], "must be a string"), (["complex", ["0x1p0"]], "[real, imag]"),
    (["device", "cuda:abc"], "Invalid device string"), (["device", ""], "must not be empty"),
    (["size", [-1]], "[0, 2^63)"), (["size", [2 ** 63]], "[0, 2^63)"),
    (["dtype", "_dynamo"], "not a dtype"), (["dtype", "Tensor"], "not a dtype"),
    (["int", "12"], "hex text"), (["int", True], "integer"), (["none", 0], "null"),
    (["bool", 1], "true or false"), (["tuple", []], "unknown value type"),
    ([["int"], 1], "expected [type, value]"), ("x", "expected [type, value]"),
])
def test_malformed_inline_value_is_refused_by_check_values(value, says):
    """decode leaves inline values to check_values (which verify runs, and which a load's
    values.decode matches): ManifestError naming the key and what is wrong."""
    body = good_body()
    body["objects"][0]["value"] = value
    m = manifest.decode(wrap(body), WHERE)
    with pytest.raises(ManifestError) as info:
        manifest.check_values(m, WHERE)
    assert "object 'step'" in str(info.value) and says in str(info.value), str(info.value)
    assert WHERE in str(info.value)


def test_check_values_accepts_every_encodable_value():
    import torch

    from ckptio.format import values

    m = good_manifest()
    leaves = [None, True, -(2 ** 70), 3, 0.1, float("-inf"), float("nan"), complex(1, -0.0), "ü",
              torch.Size([2, 0]), torch.float8_e4m3fn, torch.device("cuda", 3)]
    objects = tuple(ObjectEntry(f"v{i}", values.encode(v)) for i, v in enumerate(leaves))
    manifest.check_values(dataclasses.replace(m, objects=objects), WHERE)
    for v, o in zip(leaves, objects):
        got = values.decode(o.value)
        assert type(got) is type(v) and (got == v or v != v), (got, v)


def test_check_keys_refuses_what_the_reader_would_refuse():
    """The coordinator runs the reader's key rules before committing a manifest."""
    m = good_manifest()
    manifest.check_keys(m, WHERE)
    w = m.tensors[0]
    mixed = dataclasses.replace(m, tensors=(*m.tensors, dataclasses.replace(w, rank=0)))
    with pytest.raises(ManifestError, match="both global and per-rank"):
        manifest.check_keys(mixed, WHERE)
    clash = dataclasses.replace(m, objects=(*m.objects, ObjectEntry(w.key, ["int", 1])))
    with pytest.raises(ManifestError, match="appears twice"):
        manifest.check_keys(clash, WHERE)


def test_many_rank_fields_round_trip():
    m = good_manifest()
    flat = TensorEntry("f", "tensor", "float32", (3, 5), Chunk((4,), (7,), flat=True), F1, 128,
                       28, "0123456789abcdef")
    head = TensorEntry("f", "tensor", "float32", (3, 5), Chunk((0,), (4,), flat=True), F1, 576,
                       16, "0123456789abcdef")
    tail = TensorEntry("f", "tensor", "float32", (3, 5), Chunk((11,), (4,), flat=True), F1, 640,
                       16, "0123456789abcdef")
    own = TensorEntry("r", "tensor", "uint8", (4,), Chunk.whole((4,)), F1, 192, 4,
                      "0123456789abcdef", rank=1)
    big = TensorEntry("big", "tensor", "uint8", (300,), Chunk.whole((300,)), F1, 256, 300,
                      "0123456789abcdef", blocks=("0123456789abcdef",) * 3)
    tree = {"d": [*m.tree["d"], ["f", {"k": "f"}], ["r", {"k": "r"}], ["big", {"k": "big"}],
                  ["o", {"k": "o"}]]}
    many = Manifest(m.version, m.save_id, m.checksum_algorithm, 2, m.files,
                    (*m.tensors, flat, head, tail, own, big),
                    (*m.objects, ObjectEntry("o", ["int", 1], 1)),
                    m.aliases, tree, m.meta, block_nbytes=128)
    assert manifest.decode(manifest.encode(many), WHERE) == many


def test_hostile_cases_start_from_an_accepted_body():
    """Each case above fails because of its own change, not because the base is bad."""
    body = good_body()
    body["tree"]["d"].append(["extra", {"k": "extra"}])
    body["objects"].append({"key": "extra", "value": ["none", None]})
    assert manifest.decode(wrap(body), WHERE).objects[-1] == ObjectEntry("extra", ["none", None])
    body = good_body()
    _tensor(body, "model.b")["offset"] = 8192 - 6  # the last bytes of the file are fine
    assert manifest.decode(wrap(body), WHERE).tensors[1].offset == 8192 - 6
    body = good_body()
    _tensor(body, "model.w")["chunk"] = {"offsets": [2, 0], "sizes": [2, 8]}
    _tensor(body, "model.w")["nbytes"] = 64  # a partial chunk is allowed when the chunks tile
    other = dict(_tensor(body, "model.w"), chunk={"offsets": [0, 0], "sizes": [2, 8]}, offset=192)
    body["tensors"].append(other)
    assert manifest.decode(wrap(body), WHERE).tensors[0].chunk == Chunk((2, 0), (2, 8))


def test_hostile_manifest_is_rejected_by_load(tmp_path, small_options):
    import torch

    import ckptio

    path = tmp_path / "c"
    ckptio.save({"w": torch.ones(4)}, path, options=small_options)
    file = path / manifest.MANIFEST_NAME
    header, body = split(file.read_bytes())
    body["tensors"][0]["offset"] = 1 << 40
    file.write_bytes(wrap(body))
    with pytest.raises(ManifestError, match="outside"):
        ckptio.load(path)
    with pytest.raises(ManifestError):
        ckptio.verify(path)
    body["tensors"][0]["offset"] = 0
    body["files"][0]["name"] = "../escape.bin"
    body["tensors"][0]["file"] = "../escape.bin"
    file.write_bytes(wrap(body))
    with pytest.raises(ManifestError, match="plain file name"):
        ckptio.load(path)



# --------------------------------------------------------------------------------------------
# the fast path for plain entries (validate._plain_tensor) against the field-by-field checks

_ODD = [None, -1, 0, 3, 1 << 62, 10**30, True, 1.5, "x", "0123456789abcdef", [], [0], [4, 8],
        [0, 0], [1, 0], [0, 1], [-1, 8], [4.0, 8], {}, {"offsets": [0, 0], "sizes": [4, 8]}, "float32",
        "tensor", F0]


def _entry_mutations():
    """(field path, value) for every field of a plain entry, and every odd value there."""
    fields = ["key", "kind", "dtype", "shape", "chunk", "file", "offset", "nbytes", "checksum",
              "blocks", "rank", "stored", "ref", "xor", ("chunk", "offsets"),
              ("chunk", "sizes"), ("chunk", "flat")]
    for field in fields:
        for value in [*_ODD, "DROP"]:
            yield field, value
    yield "blocks", ["0123456789abcdef"] * 2
    yield "blocks", ["0123456789abcdef", "0123456789ABCDEF"]
    yield ("chunk", "flat"), False
    yield ("chunk", "flat"), 0
    for shape in ([], [1] * manifest.MAX_NDIM, [1] * (manifest.MAX_NDIM + 1), [0, 5],
                  [2 ** 61, 2 ** 61, 0], [2 ** 30, 2 ** 30, 0]):
        yield "WHOLE", shape  # shape, chunk and nbytes agreeing with each other


def _whole(raw: dict, shape: list) -> dict:
    numel = 1
    for d in shape:
        numel *= d
    itemsize = {"float32": 4, "bfloat16": 2, "float64": 8, "int16": 2, "uint8": 1}[raw["dtype"]]
    return dict(raw, shape=shape, chunk={"offsets": [0] * len(shape), "sizes": shape},
                nbytes=numel * itemsize)


def _mutated(raw: dict, field, value) -> dict:
    raw = json.loads(json.dumps(raw))
    if field == "WHOLE":
        return _whole(raw, value)
    target, name = (raw, field) if isinstance(field, str) else (raw.get("chunk"), field[1])
    if isinstance(target, dict):
        if value == "DROP":
            target.pop(name, None)
        else:
            target[name] = value
    return raw


@pytest.mark.parametrize("block_nbytes", [1 << 20, 64])
def test_the_fast_path_accepts_only_what_the_field_checks_accept(block_nbytes):
    """validate._plain_tensor takes the common entry without building messages; on every
    entry, plain or mutated field by field, it returns None or exactly the entry _tensor
    returns, and never accepts one _tensor refuses (so no check is lost)."""
    from ckptio.format import validate
    from ckptio.format.check import Check

    body = good_body()
    sizes = {f["name"]: f["nbytes"] for f in body["files"]}
    taken = refused = 0
    for raw in body["tensors"]:
        for field, value in [("key", raw["key"]), *_entry_mutations()]:
            entry = _mutated(raw, field, value)
            fast = validate._plain_tensor(entry, sizes, block_nbytes)
            try:
                slow = validate._tensor(Check(WHERE), entry, sizes, 1, block_nbytes,
                                        manifest.VERSION)
            except ManifestError:
                assert fast is None, (field, value, entry)
                refused += 1
                continue
            assert fast is None or fast == slow, (field, value, entry)
            taken += fast is not None
    assert taken and refused


def test_the_fast_path_takes_every_entry_of_a_real_save(tmp_path, small_options):
    """A save's global tensor entries all go through the fast path, and decode to the same
    Manifest as through the field checks alone."""
    import torch

    import ckptio
    from ckptio.format import validate

    state = {"w": torch.randn(64, 33), "b": torch.zeros(3, dtype=torch.bfloat16),
             "e": torch.empty(0, 4), "i": torch.arange(5), "n": 3}
    ckptio.save(state, tmp_path / "c", options=small_options)
    data = (tmp_path / "c" / manifest.MANIFEST_NAME).read_bytes()
    body = split(data)[1]
    sizes = {f["name"]: f["nbytes"] for f in body["files"]}
    assert all(validate._plain_tensor(t, sizes, body["block_nbytes"]) is not None
               for t in body["tensors"])
    fast = manifest.decode(data, WHERE)
    plain = validate._plain_tensor
    try:
        validate._plain_tensor = lambda *_args: None
        assert manifest.decode(data, WHERE) == fast
    finally:
        validate._plain_tensor = plain
