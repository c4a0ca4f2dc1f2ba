#!/usr/bin/env python3
"""Mutation check of the GPU path's synchronisations (README.md beside this file).

Each mutation deletes one synchronisation the GPU path relies on (a stream or event sync, an event
record, a stream-wait-event, a fence, a ticket wait, the caller's stream or record_stream), by a
textual replacement of a pattern that occurs exactly once in its file. For each one, this script
applies it to the source tree, rebuilds the emulated tests in an emulation build directory, runs
them, restores the file, and reports whether a test caught it (a failure, a crash or a timeout)
or it survived. A mutation whose pattern is not found exactly once, or that does not compile, is
reported as such (the list needs updating), never as caught.

    cmake -S . -B build-emu -DMEMPLAN_GPU_EMULATION=ON -DCMAKE_BUILD_TYPE=Debug \\
      -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" -DMEMPLAN_WERROR=ON
    python3 tests/gpu_emulation/mutate.py --build-dir build-emu          # assertions only
    python3 tests/gpu_emulation/mutate.py --build-dir build-tsan         # under ThreadSanitizer
    python3 tests/gpu_emulation/mutate.py --only R2,S10 --list           # a few; the list

Exit status: 0 when every mutation is caught, 1 otherwise. Not part of the default suite: it
rebuilds once per mutation (about 30 s each on two cores).
"""
import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (id, file, pattern, replacement, what is deleted)
MUTATIONS = [
    # gpu/cuda_runtime.cc
    ("R1", "gpu/cuda_runtime.cc",
     "if (lane.stream != nullptr) (void)cudaStreamSynchronize(lane.stream);",
     "(void)lane;",
     "~CudaRuntime: drain the copy streams before destroying them"),
    ("R2", "gpu/cuda_runtime.cc",
     "MEMPLAN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.event));", "",
     "CopyAsync: wait for the oldest copy when the event ring is full"),
    ("R3", "gpu/cuda_runtime.cc",
     "MEMPLAN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.event, lane.stream));", "",
     "CopyAsync: record the copy's completion event"),
    ("R4", "gpu/cuda_runtime.cc",
     "const cudaError_t err = cudaEventSynchronize(event);",
     "const cudaError_t err = ((void)event, cudaSuccess);",
     "Wait: cudaEventSynchronize on the ticket's event"),
    ("R5", "gpu/cuda_runtime.cc",
     "const cudaError_t err = cudaEventQuery(event);",
     "const cudaError_t err = ((void)event, cudaSuccess);",
     "Done: cudaEventQuery (answers done at once)"),
    ("R6", "gpu/cuda_runtime.cc",
     "const cudaError_t err = cudaStreamSynchronize(lane.stream);",
     "const cudaError_t err = cudaSuccess;",
     "Synchronize: cudaStreamSynchronize of each copy stream"),
    ("R7", "gpu/cuda_runtime.cc",
     "const cudaError_t err = cudaEventRecord(event, static_cast<cudaStream_t>(stream.handle));",
     "const cudaError_t err = ((void)stream, cudaSuccess);",
     "RecordFence: record the event on the caller's stream"),
    ("R8", "gpu/cuda_runtime.cc",
     "MEMPLAN_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(lane.stream, event, 0));", "(void)event;",
     "WaitFence: cudaStreamWaitEvent of the copy stream on the fence"),
    ("R9", "gpu/cuda_runtime.cc",
     "MEMPLAN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event));", "(void)event;",
     "WaitFenceOnHost: cudaEventSynchronize on the fence"),
    ("R10", "gpu/gpu_runtime.cc",
     "return WaitFence(direction, fence);", "(void)direction;\n  return Status::Ok();",
     "Runtime::OrderAfter: the WaitFence after RecordFence"),
    # offload/nccl_collective.cc
    ("N1", "offload/nccl_collective.cc",
     "ncclAllGather(send, recv, count, NcclType(type), comm_, stream_), call));\n"
     "    return Finish(call);",
     "ncclAllGather(send, recv, count, NcclType(type), comm_, stream_), call));\n"
     "    return Status::Ok();",
     "AllGather: wait for the collective's stream (Finish)"),
    ("N2", "offload/nccl_collective.cc",
     "ncclSum, comm_, stream_), call));\n    return Finish(call);\n  }\n\n  Status AllReduce",
     "ncclSum, comm_, stream_), call));\n    return Status::Ok();\n  }\n\n  Status AllReduce",
     "ReduceScatter: wait for the collective's stream (Finish)"),
    ("N3", "offload/nccl_collective.cc",
     "ncclAllReduce(buffer, buffer, count, NcclType(type), ncclSum, comm_, stream_), call));\n"
     "    return Finish(call);",
     "ncclAllReduce(buffer, buffer, count, NcclType(type), ncclSum, comm_, stream_), call));\n"
     "    return Status::Ok();",
     "AllReduce: wait for the collective's stream (Finish)"),
    ("N4", "offload/nccl_collective.cc",
     "(void)cudaStreamSynchronize(stream_);", "",
     "~NcclCollective: drain the collective's stream before destroying it"),
    ("N5", "offload/nccl_collective.cc",
     'MEMPLAN_RETURN_IF_ERROR(Poll("creating the communicator (ncclCommInitRankConfig)", '
     "timeout_));", "",
     "Init: wait for the non-blocking communicator to be created"),
    ("N6", "offload/nccl_collective.cc",
     'Poll("ncclCommFinalize", std::min(timeout_, kFinalizeTimeout)).ok()', "true",
     "~NcclCollective: wait for the non-blocking finalize before destroying"),
    # offload/collective.cc (the single-process collective on the CUDA runtime)
    ("C1", "offload/collective.cc",
     "return runtime_->Wait(ticket).WithPrefix(",
     "(void)ticket;\n    return Status::Ok().WithPrefix(",
     "single-process collective: wait for its device-to-device copy"),
    # offload/param_swapper.cc
    ("S1", "offload/param_swapper.cc",
     "    (void)options.runtime->Synchronize();\n    for (PendingFree& f",
     "    for (PendingFree& f",
     "~ParamSwapper: Synchronize before freeing buffers and the pinned arena"),
    ("S2", "offload/param_swapper.cc",
     "for (const auto& [stream, fence] : f.fences) (void)options.runtime->WaitFenceOnHost(fence);",
     "(void)f;", "~ParamSwapper: wait for the release fences of buffers pending free"),
    ("S3", "offload/param_swapper.cc",
     "for (const auto& [stream, fence] : p.fences) (void)options.runtime->WaitFenceOnHost(fence);",
     "(void)p;", "~ParamSwapper: wait for the release fences of parameters kept"),
    ("S4", "offload/param_swapper.cc",
     "Status waited = options.runtime->WaitFence(LoadLane(), fence);",
     "Status waited;\n        (void)fence;",
     "FlushPendingFrees: order the load lane after the trainer's release fences (defect 1)"),
    ("S5", "offload/param_swapper.cc",
     "MEMPLAN_RETURN_IF_ERROR(rt.Wait(slot_ticket[s]));", "",
     "Load (nvme): wait for a staging slot's previous upload before refilling it"),
    ("S6", "offload/param_swapper.cc",
     "MEMPLAN_RETURN_IF_ERROR(rt.Wait(last));  // `values` may be reused once we return",
     "(void)last;",
     "Write: wait for the uploads of the caller's values"),
    ("S7", "offload/param_swapper.cc",
     "  MEMPLAN_RETURN_IF_ERROR(rt.Wait(last));\n  MutexLock lock(&s.mu);\n"
     "  s.stats.allgather_bytes",
     "  (void)last;\n  MutexLock lock(&s.mu);\n  s.stats.allgather_bytes",
     "GatherResident: wait for the copies out of the gathered pack"),
    ("S8", "offload/param_swapper.cc",
     "Status waited = s.options.runtime->Wait(ticket);", "Status waited;",
     "Fetch: wait for the parameter's load"),
    ("S9", "offload/param_swapper.cc",
     "MEMPLAN_ASSIGN_OR_RETURN(gpu::Fence fence, s.options.runtime->RecordFence(stream));",
     "gpu::Fence fence;",
     "Release: record the fence of the trainer's stream (defect 1)"),
    ("S10", "offload/param_swapper.cc",
     "for (const gpu::CopyTicket& t : pending) MEMPLAN_RETURN_IF_ERROR(s.options.runtime->Wait(t));",
     "", "EndOfStep: wait for the copies of the prefetches it drops"),
    # offload/engine.cc
    ("E1", "offload/engine.cc",
     "Status status = runtime->Wait(job.ticket);", "Status status;",
     "gradient thread: wait for a gradient's copy into pinned staging before reading it"),
    ("E2", "offload/engine.cc",
     "MEMPLAN_RETURN_IF_ERROR(runtime->OrderAfter(gpu::CopyDirection::kDeviceToDevice, stream));",
     "(void)stream;", "ReduceScatterGradient: order the copy after the trainer's stream"),
    ("E3", "offload/engine.cc",
     "MEMPLAN_RETURN_IF_ERROR(runtime->Wait(copied));", "(void)copied;",
     "ReduceScatterGradient: wait for the gradient's copy into scratch"),
    ("E4", "offload/engine.cc",
     "MEMPLAN_RETURN_IF_ERROR(runtime->Wait(zeroed));", "(void)zeroed;",
     "ReduceScatterGradient: wait for the zero padding of the scratch"),
    ("E5", "offload/engine.cc",
     "                                                zeros.data(), zeros.size()));\n"
     "    return runtime->Wait(ticket);",
     "                                                zeros.data(), zeros.size()));\n"
     "    (void)ticket;\n    return Status::Ok();",
     "the zero buffer's upload: wait before the host vector goes"),
    ("E6", "offload/engine.cc",
     "MEMPLAN_RETURN_IF_ERROR(s.runtime->OrderAfter(gpu::CopyDirection::kDeviceToHost, stream));",
     "", "GradReady (one rank): order the gradient's copy after the trainer's stream (defect 2)"),
    ("E7", "offload/engine.cc",
     "MEMPLAN_RETURN_IF_ERROR(s.runtime->Wait(up));", "(void)up;",
     "gathering the master weights: wait for the upload before the all-gather"),
    ("E8", "offload/engine.cc",
     "return s.runtime->Wait(down);", "(void)down;\n    return Status::Ok();",
     "gathering the master weights: wait for the download"),
    ("E9", "offload/engine.cc",
     "(void)s.runtime->Synchronize();  // a copy may still read a scratch buffer", "",
     "Close: Synchronize before freeing the gradient scratch buffers"),
    # integration/c_api.cc: the caller's stream reaches the engine
    ("A1", "integration/c_api.cc",
     "return engine->engine->Release(module, memplan::gpu::Stream{stream});",
     "(void)stream;\n    return engine->engine->Release(module, memplan::gpu::Stream{});",
     "memplan_engine_release: the caller's stream (replaced by the default stream)"),
    ("A2", "integration/c_api.cc",
     "return engine->engine->GradReady(param_id, grad, type, memplan::gpu::Stream{stream});",
     "(void)stream;\n    return engine->engine->GradReady(param_id, grad, type, "
     "memplan::gpu::Stream{});",
     "memplan_engine_grad_ready: the caller's stream (replaced by the default stream)"),
    # The trainer's side, as memplan.torch does it (tests drive the engine the same way)
    ("T1", "tests/gpu_emulation/emulated_training.h",
     "if (o.record_stream) compute.RecordStream(g, GradientStreamOf(engine));", "",
     "trainer: grad.record_stream(gradient stream) before dropping the gradient"),
    ("T2", "tests/gpu_emulation/c_api_emulated_test.cc",
     "allocator->RecordStream(g, static_cast<cudaStream_t>(GradientStream(engine)));",
     "(void)GradientStream(engine);",
     "C API trainer: record the gradient on the engine's gradient stream"),
]

# Deletions no test can see, and why: reported as "survived (expected: ...)" and not counted
# against the exit status. Each is a line to keep (it states the ordering the code relies on, and
# it would matter if the memory came from elsewhere), not one a test forgot.
CUDAFREE = ("equivalent: the cudaFree that follows synchronises the device (CUDA's does; so "
            "does the emulation's)")
EXPECTED_SURVIVORS = {
    "N4": ("equivalent: every collective waits for its stream before returning (Finish), so "
           "nothing is queued when the communicator goes"),
    "N6": ("not modelled: the emulated ncclCommFinalize completes at once, so a destroy during a "
           "finalize still in progress cannot be seen"),
    "S1": CUDAFREE + ", before the pinned arena and staging slots are let go",
    "S2": CUDAFREE,
    "S3": CUDAFREE,
    "E9": CUDAFREE,
}

# Deletions that leave every value right on the emulation's timing and are seen only as the race
# they open (two emulated streams touching the same bytes unordered): caught in a ThreadSanitizer
# build (build-tsan, as CI runs these tests), reported as "survived (TSan only)" elsewhere.
TSAN_ONLY = {"E4", "E5", "T1", "T2"}

TARGETS = ["gpu_emulation_test", "c_api_emulated_test", "offload_gpu_test"]
BINARIES = ["tests/gpu_emulation/gpu_emulation_test", "tests/gpu_emulation/c_api_emulated_test",
            "offload/offload_gpu_test"]


def first_failure(output):
    """The first failing test case doctest names, or the last line when it crashed."""
    name = None
    for line in output.splitlines():
        m = re.match(r"TEST CASE:\s+(.*)", line)
        if m:
            name = m.group(1).strip()
        if ("ERROR:" in line or "WARNING: ThreadSanitizer" in line or "FATAL" in line) and name:
            return name
    if "WARNING: ThreadSanitizer" in output:
        return "ThreadSanitizer report (%s)" % (name or "outside a test case")
    lines = [l for l in output.splitlines() if l.strip()]
    return lines[-1][:120] if lines else "no output"


def build(build_dir):
    r = subprocess.run(["cmake", "--build", build_dir, "-j2", "--target"] + TARGETS,
                       cwd=ROOT, capture_output=True, text=True)
    return r.returncode == 0, r.stdout + r.stderr


def run_tests(build_dir, timeout):
    env = dict(os.environ)
    env.setdefault("TSAN_OPTIONS", "halt_on_error=1")
    for binary in BINARIES:
        path = os.path.join(ROOT, build_dir, binary)
        if not os.path.exists(path):
            continue
        try:
            r = subprocess.run([path, "--abort-after=1"], cwd=os.path.join(ROOT, build_dir),
                               capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return "caught", "%s: timed out after %d s" % (os.path.basename(binary), timeout)
        if r.returncode != 0:
            return "caught", "%s: %s" % (os.path.basename(binary),
                                         first_failure(r.stdout + r.stderr))
    return "survived", ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", default="build-emu",
                    help="an emulation build (-DMEMPLAN_GPU_EMULATION=ON), relative to the root")
    ap.add_argument("--only", default="", help="comma-separated mutation ids")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per test binary")
    args = ap.parse_args()
    # A ThreadSanitizer build (its CMakeCache says so) sees the races TSAN_ONLY lists.
    cache = os.path.join(args.build_dir, "CMakeCache.txt")
    tsan = os.path.exists(cache) and "MEMPLAN_SANITIZE:STRING=thread" in open(cache).read()
    chosen = [m for m in MUTATIONS if not args.only or m[0] in args.only.split(",")]
    if args.list:
        for mid, path, pattern, _, what in chosen:
            print("%-4s %s: %s\n     %s" % (mid, path, what, pattern.split("\n")[0].strip()))
        return 0
    ok, log = build(args.build_dir)
    if not ok:
        print(log[-3000:])
        print("mutate.py: the unmutated tree does not build in %s" % args.build_dir)
        return 2
    status, detail = run_tests(args.build_dir, args.timeout)
    if status != "survived":
        print("mutate.py: the unmutated tests fail: %s" % detail)
        return 2
    results = []
    for mid, path, pattern, replacement, what in chosen:
        full = os.path.join(ROOT, path)
        with open(full) as f:
            original = f.read()
        count = original.count(pattern)
        line = original[:original.find(pattern)].count("\n") + 1 if count else 0
        where = "%s:%d" % (path, line)
        if count != 1:
            results.append((mid, where, what, "pattern found %d times" % count, ""))
            print(results[-1], flush=True)
            continue
        start = time.time()
        try:
            with open(full, "w") as f:
                f.write(original.replace(pattern, replacement))
            ok, log = build(args.build_dir)
            if not ok:
                errors = [l for l in log.splitlines() if "error" in l]
                status, detail = "does not build", (errors[0] if errors else log[-200:])
            else:
                status, detail = run_tests(args.build_dir, args.timeout)
                if status == "survived" and mid in EXPECTED_SURVIVORS:
                    status = "survived (expected: %s)" % EXPECTED_SURVIVORS[mid]
                elif status == "survived" and mid in TSAN_ONLY and not tsan:
                    status = "survived (expected: seen by ThreadSanitizer only; run in build-tsan)"
        finally:
            with open(full, "w") as f:
                f.write(original)
        results.append((mid, where, what, status, detail))
        print("%-4s %-34s %-9s %s (%.0f s)" % (mid, where, status, detail, time.time() - start),
              flush=True)
    build(args.build_dir)  # leave the build matching the restored tree
    print("\n| id | where | synchronisation deleted | result | caught by |")
    print("|----|-------|-------------------------|--------|-----------|")
    for mid, where, what, status, detail in results:
        print("| %s | %s | %s | %s | %s |" % (mid, where, what, status, detail))
    caught = sum(1 for r in results if r[3] == "caught")
    expected = sum(1 for r in results if r[3].startswith("survived (expected"))
    print("\n%d of %d mutations caught, %d survived as expected" % (caught, len(results), expected))
    return 0 if caught + expected == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
