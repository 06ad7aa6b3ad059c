"""The allow-lists of tests/structure_trees.py: the private reaches benchmarks/ and tests/ may
make, each with why. An entry that no longer occurs fails tests/test_structure.py."""

from __future__ import annotations

__all__ = ["BENCH_REACHES", "OUTSIDE_THIRD_PARTY", "TEST_REACHES"]

# "module: expression" -> why benchmarks/ cannot use public API there.
BENCH_REACHES: dict[str, str] = {
    "benchmarks.pathtrace.tracer: thread_self._pathtrace_parent":
        "the tracer's own mark on each thread it sees start (the starting frame, read back by "
        "the same tracer in the new thread); a name no other code uses",
    "benchmarks.load_phases: read._submit":
        "--trace times each read the load's read loop submits (size, in flight, done): the "
        "loop's own step, which no public API shows",
    "benchmarks.load_phases: read._apply":
        "--trace times each read's check and copy, on the thread that runs it: the loop's own "
        "step, which no public API shows",
}

# Private names of other libraries that benchmarks/ (and tests/) use, each with why, as
# tests/structure.py's THIRD_PARTY lists the package's.
OUTSIDE_THIRD_PARTY: dict[str, str] = {
    "os._exit": "the documented exit of a process without cleanup: a rank killed mid-save",
    "sys._getframe": "the tracer's starting frame (pathtrace; CPython's documented call)",
    "sys._current_frames": "whether the long-lived save thread is back idle (gc_pressure: "
                           "CPython's documented call; the thread is never joined now)",
    "torch._foreach_copy_": "the peer's fastest copy of many tensors (what a hand-written "
                            "restore or a GIL probe would use); torch exposes no public one",
    "stager._state_dict_stager": "DCP's staging object inside DefaultStager: kept open on torch "
                                 "< 2.13 and its pinned bytes counted (gpu_engines)",
    "stager._cached_storage_mapping": "DCP's pinned staging storages, counted as the peer's "
                                      "page-locked memory (no public size)",
    "LocalElasticAgent._monitor_workers": "torchrun's agent steps, wrapped to time a recovery's "
                                          "phases (recovery_agent); no public hook",
    "LocalElasticAgent._restart_workers": "as _monitor_workers: the restart step's time",
    "body._raw_stream._fp": "the socket file under botocore's stream: the S3 ceiling reads into "
                            "a buffer without botocore's copy (s3_ceiling --direct)",
    "s3torchconnectorclient._mountpoint_s3_client": "the CRT client the peer library wraps, "
                                                    "measured bare (s3_clients)",
    "torch.distributed.checkpoint._fsspec_filesystem": "DCP's own fsspec writer and reader, the "
                                                       "peer for S3 (not exported publicly)",
    "torch.distributed.checkpoint._extension": "DCP's ZStandard extension, the compressed peer",
    "torch.distributed.checkpoint._consolidate_hf_safetensors": "DCP's consolidation of HF "
                                                                "safetensors, the export peer",
    "torch.distributed.checkpoint.filesystem._StorageInfo": "DCP's storage record in its "
                                                            "metadata (a DCP directory made by "
                                                            "hand, a plan simulated)",
    "torch.distributed.tensor.placement_types._StridedShard": "FSDP2+TP's placement, which "
                                                              "DCP must load (strided layouts)",
}

_HELPER = "a helper shared by test files (one home): used as the defining test file uses it"
_WHITE = "a white-box check of "

# test module -> (why it reaches privates of what it tests, the expressions it may use).
TEST_REACHES: dict[str, tuple[str, frozenset[str]]] = {
    "tests.azure_blob.conftest": (_WHITE + "the client's reached-endpoint memory, reset between "
                                  "tests", frozenset({"az_client._reached"})),
    "tests.dist_cases": (_WHITE + "a checkpointer's plan memories; FSDP2+TP's placement",
                         frozenset({"ck._ranks", "torch.distributed.tensor.placement_types"
                                    "._StridedShard"})),
    "tests.fetch_cases": (_WHITE + "a stripe's checksum", frozenset({"stripes._sum"})),
    "tests.gpu.test_cuda": (_WHITE + "the rank plan's digest", frozenset({
        "ckptio.distributed.rankplan._digest"})),
    "tests.gpu.test_cuda_tiers": (_HELPER, frozenset({
        "tests.test_mapped_save._assert_no_stale_bytes", "tests.test_mapped_save._inodes"})),
    "tests.restart_plan_cases": (_WHITE + "counts each DTensor region worked out (the function "
                                 "a load calls per leaf)", frozenset({"sharding._dtensor"})),
    "tests.readshare_cases": (_WHITE + "a shared read's send buffer; a rank killed with os._exit",
                              frozenset({"os._exit", "sendreads._send_buffer"})),
    "tests.redundancy_sharded_cases": (_HELPER, frozenset({
        "tests.redundancy_cases._DELTA", "tests.redundancy_cases._play_host",
        "tests.redundancy_cases._tiers"})),
    "tests.regrow_cases": (_HELPER, frozenset({"tests.redundancy_cases._play_host",
                                               "tests.redundancy_cases._tiers"})),
    "tests.reshard_once_cases": (_WHITE + "shared reads' completion and send buffers", frozenset({
        "readshare.SharedReads._read_done", "sendreads._send_buffer"})),
    "tests.s3.test_delta_s3": (_HELPER, frozenset({"s3.test_manager_s3._holding",
                                                   "s3.test_manager_s3._keys"})),
    "tests.s3.test_failfast_s3": (_WHITE + "the client's reached-endpoint memory",
                                  frozenset({"s3client._reached"})),
    "tests.s3.test_fixed_cost_s3": (_WHITE + "the client factory, counted",
                                    frozenset({"s3client._make_client"})),
    "tests.s3.test_manager_s3": (_HELPER, frozenset({"cases._manager_state"})),
    "tests.s3.test_rt_known_s3": (_WHITE + "the client factory: small listing pages",
                                  frozenset({"s3client._make_client"})),
    "tests.s3.test_rt_s3": (_HELPER, frozenset({"s3.test_silent_s3._options"})),
    "tests.s3.test_server_and_proxy": ("botocore's signer credentials, checked against the "
                                       "fixture's", frozenset({
                                           "client._request_signer",
                                           "client._request_signer._credentials"})),
    "tests.s3.test_tiers_s3": (_HELPER, frozenset({"s3.test_manager_s3._holding",
                                                   "s3.test_manager_s3._keys"})),
    "tests.s3.test_torchtitan_s3": (_HELPER, frozenset({"s3.test_manager_s3._holding"})),
    "tests.s3.test_tune_s3": (_WHITE + "the client factory and reached-endpoint memory",
                              frozenset({"s3client._make_client", "s3client._reached"})),
    "tests.sharded_tensor_cases": ("torch's ShardedTensor, which lives in a private package",
                                   frozenset({"torch.distributed._shard",
                                              "torch.distributed._shard.sharding_spec"})),
    "tests.test_async": (_WHITE + "the plan cache", frozenset({"ck._plan_cache"})),
    "tests.test_bench_dlio": ("resets the DLIO engines' per-process singleton between tests",
                              frozenset({"engine_module.CkptioCheckpointing._instance",
                                         "engine_module.TorchFsyncCheckpointing._instance"})),
    "tests.test_bench_train": ("torch's optimizer hooks, checked empty after a step",
                               frozenset({"opt._optimizer_step_pre_hooks"})),
    "tests.test_cli_interop": (_HELPER, frozenset({"test_cli_ls._on_a_terminal"})),
    "tests.test_cli_ls": (_WHITE + "the command line's parser (every command documented), "
                          "through argparse's", frozenset({
                              "argparse._HelpAction", "argparse._SubParsersAction",
                              "ckptio.cli._parser", "command._actions", "parser._actions",
                              "sub._choices_actions"})),
    "tests.test_commit": (_WHITE + "the cleanup after a commit", frozenset({
        "ck._finish_cleanup"})),
    "tests.test_concurrent": (_WHITE + "the cleanup after a commit", frozenset({
        "fast._finish_cleanup"})),
    "tests.test_crc32": (_WHITE + "each CRC-32 implementation against the others", frozenset({
        "checksum._CRC32", "checksum._fastest_crc32"})),
    "tests.test_dcp_fixtures": ("DCP's storage record, to make a DCP directory by hand",
                                frozenset({"torch.distributed.checkpoint.filesystem._StorageInfo"})),
    "tests.test_dcp_reader": ("DCP's own partial load, the reference the reader is checked "
                              "against", frozenset({
                                  "torch.distributed.checkpoint.state_dict_loader"
                                  "._load_state_dict_from_keys"})),
    "tests.test_dcpmeta": ("DCP's storage record, to make DCP metadata by hand",
                           frozenset({"torch.distributed.checkpoint.filesystem._StorageInfo"})),
    "tests.test_first_save_prepare": (_WHITE + "staging's page population", frozenset({
        "stage._populate"})),
    "tests.test_fuzz": (_WHITE + "every value decoder, fuzzed", frozenset({"values._DECODERS"})),
    "tests.test_io_uring": (_WHITE + "the io_uring backend's ring, registered buffers and "
                            "reaper, which no public call shows", frozenset({
                                "backend._fixed_index", "backend._parts", "backend._reaper",
                                "backend._registered", "backend._ring",
                                "files.backend._registered", "io._capable", "pool._mapping"})),
    "tests.test_layers": (_WHITE + "the CLI's checkout finder (benchmarks from a checkout)",
                          frozenset({"cli._checkout"})),
    "tests.test_manifest": (_WHITE + "the manifest's tensor validation", frozenset({
        "validate._plain_tensor", "validate._tensor"})),
    "tests.test_memory": (_WHITE + "the cleanup after a commit", frozenset({
        "ck._finish_cleanup"})),
    "tests.test_read": (_WHITE + "the read path's steps and a tensor's version counter",
                        frozenset({"dest._version", "posix._pread_all", "read_module._apply",
                                   "read_module._run", "stage._populate"})),
    "tests.test_restore_from_memory": (_WHITE + "the reads a restore makes", frozenset({
        "posix._pread_each", "stage._populate"})),
    "tests.test_rt_cli": (_HELPER, frozenset({"test_cli_interop._one_line_error"})),
    "tests.test_rt_fresh_shared": (_WHITE + "a shared read's send buffer (a sender that dies)",
                                   frozenset({"sendreads._send_buffer"})),
    "tests.test_rt_mem": (_WHITE + "the memory tier's slots, made behind a restore: waited "
                          "for before they are counted", frozenset({"mgr._levels"})),
    "tests.test_rt_readonce": (_WHITE + "a shared read's send buffer (a send damaged); its "
                               "posting (a rank frozen once posted)",
                               frozenset({"sendreads._send_buffer", "sendreads._post"})),
    "tests.test_s3client": (_WHITE + "the client cache", frozenset({"s3client._clients"})),
    "tests.test_stage_copy_in": (_WHITE + "the staging pool and a tensor's version counter",
                                 frozenset({"pool._all", "whole._version"})),
    "tests.test_staging": (_WHITE + "staging's views and page population",
                           frozenset({"buffer._views", "ckptio.io.stage._populate"})),
    "tests.test_rt_known": (_WHITE + "the drain's and the manager's backends, faults there",
                            frozenset({"mgr._drain", "mgr._drain._resources",
                                       "saver._ck"})),
    "tests.test_storegroup": (_WHITE + "the store group's wait", frozenset({"group._wait"})),
    "tests.test_strided_shard": ("FSDP2+TP's placement and torch's fake process group",
                                 frozenset({"torch.distributed.tensor.placement_types"
                                            "._StridedShard",
                                            "torch.testing._internal.distributed.fake_pg"})),
    "tests.test_tc_checkpoints": (_HELPER, frozenset({
        "test_dcp_in._assert_same", "test_dcp_in._build", "test_dcp_in._dcp_state",
        "test_dcp_in._objects", "test_dcp_in._snapshot", "test_dcp_in._step"})),
    "tests.test_tiers": (_WHITE + "the manager's drain", frozenset({"mgr._drain"})),
    "tests.test_torchtitan": ("torchtitan's checkpoint owner, checked replaced", frozenset({
        "config.checkpoint._owner"})),
}
