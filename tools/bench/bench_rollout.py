"""Rollout on CPU: weight-sync speed of every mode against the machine's limits, and generation throughput.

The model is a random-weight Qwen2 written by megappo's test factory (no download), fp32; the defaults (16 layers,
hidden 1024, vocabulary 32000) make 1.1 GB. A world-1 megatron actor of the same model is the sender. Printed:
- header: model size, threads, torch version, machine load (os.getloadavg: others may be running tests);
- machine limits, measured in this run: memory copy (torch copy_ of a 1 GB tensor, best of 5 at the start and 5
  at the end: a loaded machine slows single tries), disk write (+fsync) and read of 1 GB in --dir's filesystem
  (the read may come from the page cache);
- weight sync, one row per mode: first call, steady state (median of the next --repeats), GB/s of the steady
  state, % of the memory-copy bandwidth (and of the disk for disk), the export's share of the steady time. Every
  mode goes through `iter_hf_weights` (--bucket-mb buckets) as RolloutWorker.sync_weights does (for SGLang:
  pause, send, resume, check_version):
    export              iterate iter_hf_weights only, fresh copies (what `convert` and the disk writer get)
    export:views        the same with copy=False (views of the parameters): the sender's share of the modes below
    hf:tensor           HFEngine.update_weights (in process; the CPU default)
    sglang:distributed  SGLangFleet.update_weights (one gloo broadcast per bucket, flattened, to the server)
    sglang:tensor       SGLangFleet.update_weights_from_tensor (persistent shared-memory staging, handles)
    sglang:disk         write_actor_hf_dir, then update_weights_from_disk (each phase on a row of its own)
  hf, distributed and tensor export with copy=False, as RolloutWorker.sync_weights does for them on CPU.
- the ceiling of `distributed`: a gloo broadcast of one --bucket-mb tensor between two local processes (loopback
  TCP), best of 5, printed with the limits.
- generation: --prompts x --n responses of --new-tokens tokens (EOS ignored) on HFEngine and on the SGLang server,
  tokens/s and seconds.
- the sync floor (--floor-repeats, 0: skip): the fixed cost of one SGLang sync, apart from the bandwidth. A tiny
  Qwen2 (the test suite's, 0.9 MB) on a server of its own, synced --floor-repeats times per mode (median after the
  first) as RolloutWorker.sync_weights does it: the heal's health probe (`is_healthy`), pause, send (the export
  from a megatron actor included; for disk the HF directory's write too), resume, check_version. Printed per HTTP
  call and phase, with the server's idle CPU use. Then each 1 GB row's bandwidth without the floor: size /
  (steady - floor), the floor taken without the probe (the 1 GB rows do not probe). --floor-only runs this alone.
SGLang runs from its own venv: --sglang-python, else $MEGAPPO_SGLANG_PYTHON, else the test suite's
~/.cache/megappo/sglang-cpu-<hash>/bin/python (waited for up to --sglang-wait s); without one its rows are skipped.

    python tools/bench/bench_rollout.py [--layers 16 --hidden 1024 --vocab 32000 --bucket-mb 64 --threads 2]
        [--prompts 16 --n 2 --new-tokens 64] [--modes export,hf,distributed,tensor,disk] [--no-sglang]
        [--sglang-python PY] [--server-args=--sleep-on-idle] [--floor-repeats 10] [--floor-only]
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time

import torch

GB = 1e9
ALL_MODES = "export,hf,distributed,tensor,disk"


def best_of(fn, k: int = 3) -> float:
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memcpy_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    s = best_of(lambda: dst.copy_(src), 5)
    return nbytes / GB / s


def disk_gbps(directory: str, nbytes: int = 1 << 30) -> tuple[float, float]:
    path = os.path.join(directory, "bench_disk.bin")
    block = os.urandom(64 << 20)

    def write():
        with open(path, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    def read():
        buf = bytearray(64 << 20)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    try:
        w = best_of(write, 2)
        r = best_of(read, 2)
    finally:
        os.unlink(path)
    return nbytes / GB / w, nbytes / GB / r


def _gloo_rank(rank: int, port: int, nbytes: int, threads: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(nbytes // 4) if rank == 0 else torch.empty(nbytes // 4)
    times = []
    for _ in range(6):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(t, 0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(nbytes / GB / min(times[1:]))
    dist.destroy_process_group()


def gloo_broadcast_gbps(nbytes: int, threads: int) -> float:
    """Rank 0 -> rank 1 over loopback TCP, two processes: what `distributed` mode's transport can carry at best."""
    import multiprocessing as mp

    from megappo.rollout.serving.process import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, nbytes, threads, out)) for r in range(2)]
    for p in procs:
        p.start()
    gbps = out.get(timeout=300)
    for p in procs:
        p.join()
    return gbps


def find_sglang_python(args) -> tuple[str | None, str]:
    if args.no_sglang:
        return None, "--no-sglang"
    if args.sglang_python or os.environ.get("MEGAPPO_SGLANG_PYTHON"):
        return args.sglang_python or os.environ["MEGAPPO_SGLANG_PYTHON"], ""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "tests"))
    try:
        import conftest

        venv = os.path.expanduser(f"~/.cache/megappo/sglang-cpu-{conftest._install_hash()}")
    except Exception as e:  # noqa: BLE001 - no test suite here: no SGLang
        return None, f"no SGLang python found ({e})"
    finally:
        sys.path.pop(0)
    deadline = time.time() + args.sglang_wait
    while not os.path.exists(os.path.join(venv, ".megappo-ready")):
        if time.time() > deadline:
            return None, f"{venv} is not ready (no .megappo-ready after {args.sglang_wait} s); use --sglang-python"
        time.sleep(10)
    return os.path.join(venv, "bin", "python"), ""


def timed_syncs(sync, repeats: int) -> list[float]:
    out = []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads here and OMP threads of the server")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="syncs after the first; steady state is their median")
    p.add_argument("--modes", default=ALL_MODES, help=f"comma-separated subset of {ALL_MODES}")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the model, the disk test and disk sync go")
    p.add_argument("--sglang-python", default=None)
    p.add_argument("--sglang-wait", type=float, default=600, help="seconds to wait for the test suite's SGLang venv")
    p.add_argument("--no-sglang", action="store_true")
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--server-args", default="", help="extra launch_server flags, e.g. --server-args=--sleep-on-idle")
    p.add_argument("--floor-repeats", type=int, default=10, help="tiny-model syncs per mode after the first (0: none)")
    p.add_argument("--floor-only", action="store_true", help="only the sync floor (no 1 GB model, no generation)")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    torch.set_num_threads(args.threads)
    if args.floor_only:
        sglang_python, why_not = find_sglang_python(args)
        if sglang_python is None:
            sys.exit(f"--floor-only needs SGLang: {why_not}")
        from megappo.parallel import destroy_parallel, init_parallel
        from megappo.platform import detect_platform
        from megappo.platform.layout import ParallelLayout

        plat = detect_platform()
        ps = init_parallel(ParallelLayout(), plat, seed=0)
        sglang_modes = [m for m in ("distributed", "tensor", "disk") if m in modes]
        with tempfile.TemporaryDirectory(prefix="megappo_bench_rollout_", dir=args.dir) as work:
            print("\n".join(run_floor(args, sglang_python, work, sglang_modes, ps, plat)[0]))
        destroy_parallel()
        return

    from megappo.kinds.build import build_model
    from megappo.kinds.weights import iter_hf_weights, load_hf_weights
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.rollout import HFEngine, SamplingParams
    from megappo.testing.hf_models import make_hf_model

    sglang_python, why_not = find_sglang_python(args)
    rows: list[tuple] = []  # (mode, first s, steady s, disk GB/s to compare with or None)

    with tempfile.TemporaryDirectory(prefix="megappo_bench_rollout_", dir=args.dir) as work:
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs "
              f"(others' tests may be running); torch {torch.__version__}, {args.threads} threads; dir {work}",
              flush=True)
        mem = memcpy_gbps()
        dw, dr = disk_gbps(work)
        gloo = gloo_broadcast_gbps(args.bucket_mb << 20, args.threads)
        print(f"machine: memory copy {mem:.2f} GB/s (1 GB torch copy_, best of 5); disk write+fsync {dw:.2f} GB/s, "
              f"read {dr:.2f} GB/s (1 GB; the read may be served by the page cache)", flush=True)

        hf_dir = make_hf_model("qwen2", f"{work}/hf", vocab_size=args.vocab,  # (SGLang needs the tokenizer)
                               hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                               num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                               num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=4096)
        plat = detect_platform()
        ps = init_parallel(ParallelLayout(), plat, seed=0)
        actor = build_model(hf_dir, "actor", ps, plat)
        load_hf_weights(actor, hf_dir, ps)
        cfg = load_hf_config_dict(hf_dir)
        bucket_bytes = args.bucket_mb << 20

        def buckets(copy=True):
            return iter_hf_weights(actor, ps, cfg, bucket_bytes=bucket_bytes, dtype=plat.dtype, copy=copy)

        def views():
            return buckets(copy=False)

        nbytes = sum(t.numel() * t.element_size() for b in buckets() for _, t in b)
        size = nbytes / GB
        print(f"model: qwen2 {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32, {size:.3f} GB; "
              f"{args.bucket_mb} MB buckets", flush=True)

        def add_row(mode, times, disk_ref=None):
            steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
            rows.append((mode, times[0], steady, disk_ref))
            print(f"  {mode}: " + ", ".join(f"{t:.2f}" for t in times) + " s", flush=True)

        if "export" in modes:
            add_row("export", timed_syncs(lambda: [None for _ in buckets()], args.repeats))
            add_row("export:views", timed_syncs(lambda: [None for _ in views()], args.repeats))

        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, args.vocab, (args.prompts, args.prompt_len), generator=g).tolist()
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, n=args.n, ignore_eos=True, seed=0)
        gen: list[str] = []

        def bench_generate(name, engine):
            engine.generate(prompts[:2], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
            t0 = time.perf_counter()
            out = engine.generate(prompts, params)
            s = time.perf_counter() - t0
            tokens = sum(len(c.output_ids) for group in out for c in group)
            gen.append(f"  {name}: {tokens} tokens in {s:.2f} s = {tokens / s:.1f} tokens/s")
            print(gen[-1], flush=True)

        engine = HFEngine(hf_dir)
        bench_generate("HFEngine", engine)
        if "hf" in modes:
            add_row("hf:tensor", timed_syncs(lambda: engine.update_weights(views()), args.repeats))
        engine = None  # free its 1 GB before the server loads its copy

        sglang_modes = [m for m in ("distributed", "tensor", "disk") if m in modes]
        floor_lines, floors = [], {}
        if sglang_python is None:
            gen.append(f"  SGLang: skipped: {why_not}")
            print(gen[-1], flush=True)
        else:
            if args.floor_repeats > 0 and sglang_modes:
                floor_lines, floors = run_floor(args, sglang_python, work, sglang_modes, ps, plat)
            run_sglang(args, sglang_python, hf_dir, work, cfg, buckets, views, sglang_modes, add_row,
                       bench_generate, dw, dr, plat)
        destroy_parallel()
        mem_end = memcpy_gbps()

    print(f"\nweight sync, {size:.3f} GB, {args.bucket_mb} MB buckets; steady = median of {args.repeats} after the "
          f"first. Limits: memcpy {max(mem, mem_end):.2f} GB/s (start {mem:.2f}, end {mem_end:.2f}), disk write "
          f"{dw:.2f} / read {dr:.2f} GB/s, gloo broadcast of one {args.bucket_mb} MB tensor {gloo:.2f} GB/s "
          f"(distributed's ceiling); 'export' = the steady views export's share of the mode's steady time")
    mem = max(mem, mem_end)
    export = next((r[2] for r in rows if r[0] == "export:views"), None)
    print(f"{'mode':<24}{'first s':>8}{'steady s':>9}{'GB/s':>7}{'% memcpy':>9}{'% disk':>7}{'export':>7}")
    for mode, first, steady, disk_ref in rows:
        gbps = size / steady
        pd = f"{100 * gbps / disk_ref:.0f}%" if disk_ref else ""
        pe = f"{100 * export / steady:.0f}%" if export and not mode.startswith(("export", "  disk: server")) else ""
        print(f"{mode:<24}{first:>8.2f}{steady:>9.2f}{gbps:>7.2f}{100 * gbps / mem:>8.0f}%{pd:>7}{pe:>7}")
    if floor_lines:
        print("\n" + "\n".join(floor_lines))
        print(f"bandwidth without the floor ({size:.3f} GB / (steady - floor without the probe)):")
        for mode, first, steady, disk_ref in rows:
            key = mode.split(":")[-1] if mode.startswith("sglang:") else None
            if key in floors:
                rest = steady - floors[key]
                print(f"  {mode:<22}steady {steady:.3f} s = floor {floors[key]:.3f} s + {rest:.3f} s: "
                      f"{size / max(rest, 1e-9):.2f} GB/s")
    print(f"\ngeneration: {args.prompts} prompts x n={args.n}, {args.prompt_len} prompt + {args.new_tokens} new "
          f"tokens, temperature 1, EOS ignored")
    print("\n".join(gen))
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


FLOOR_CALLS = [("probe", None), ("pause", "pause_generation"), ("begin", "begin_weight_update"),
               ("send", "update_weights_from_"), ("end", "end_weight_update"), ("resume", "continue_generation"),
               ("version", "model_info")]


def run_floor(args, python, work, modes, ps, plat) -> tuple[list[str], dict[str, float]]:
    """The sync floor (see the module's help): its printed lines, and per mode the median sync without the probe
    (s). `ps`, `plat`: the megatron parallel state and platform the tiny actor is built in."""
    import psutil

    from megappo.kinds.build import build_model
    from megappo.kinds.weights import iter_hf_weights, load_hf_weights
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.rollout import SamplingParams
    from megappo.rollout.sglang import engine as sglang_engine, fleet as sglang_fleet
    from megappo.rollout.sglang.fleet import SGLangFleet
    from megappo.rollout.sglang.health import is_healthy
    from megappo.rollout.sglang.server import SGLangServer
    from megappo.testing.hf_models import make_hf_model
    from megappo.trainer.checkpointing import write_actor_hf_dir

    tiny = make_hf_model("qwen2", os.path.join(work, "tiny"))
    actor = build_model(tiny, "actor", ps, plat)
    load_hf_weights(actor, tiny, ps)
    cfg = load_hf_config_dict(tiny)

    def buckets(copy):
        return iter_hf_weights(actor, ps, cfg, bucket_bytes=args.bucket_mb << 20, dtype=plat.dtype, copy=copy)

    nbytes = sum(t.numel() * t.element_size() for b in buckets(True) for _, t in b)
    calls: list[tuple[str, float]] = []  # (endpoint, seconds) of every request, any thread

    def recorded(http_json):
        def call(url, *a, **k):
            t0 = time.perf_counter()
            try:
                return http_json(url, *a, **k)
            finally:
                calls.append((url.rsplit("/", 1)[-1], time.perf_counter() - t0))
        return call

    originals = {m: m.http_json for m in (sglang_engine, sglang_fleet)}
    # the trainer's CPU server: SGLangServer's OMP_NUM_THREADS (1 unless set), not --threads (a tiny forward on 2
    # threads of a busy 2-core machine measured 3x slower)
    server = SGLangServer(tiny, python=python, extra_args=shlex.split(args.server_args))
    lines: list[str] = []
    floors: dict[str, float] = {}
    with server:
        tree = [psutil.Process(server.proc.pid)]
        tree += tree[0].children(recursive=True)
        cpu = lambda: sum(sum(p.cpu_times()[:2]) for p in tree if p.is_running())  # noqa: E731
        c0 = cpu()
        time.sleep(5)
        idle = (cpu() - c0) / 5
        fleet = SGLangFleet([server.url], timeout=600, engine_kwargs={"api_key": server.api_key})
        sync_dir = os.path.join(work, "tiny_sync")
        sends = {"distributed": lambda v: fleet.update_weights(buckets(False), version=v),
                 "tensor": lambda v: fleet.update_weights_from_tensor(buckets(False), version=v),
                 "disk": lambda v: (write_actor_hf_dir(buckets(True), cfg, tiny, sync_dir, plat.dtype),
                                    fleet.update_weights_from_disk(sync_dir, version=v))}
        version = 0
        table = []
        rollout, params = [[5, 6, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True)
        for m in originals:
            m.http_json = recorded(originals[m])
        try:
            for mode in modes:
                per_sync = []
                for _ in range(1 + args.floor_repeats):
                    version += 1
                    fleet.generate(rollout, params)  # the step's rollout, between two syncs (the first forward
                    calls.clear()  # after a weight update is slower: it is the rollout's, not the sync's)
                    t0 = time.perf_counter()
                    assert is_healthy(server.url)  # ServerSet.heal, before weight_sync.around_sync
                    probe = time.perf_counter() - t0
                    fleet.pause()
                    try:
                        sends[mode](version)
                    finally:
                        fleet.resume()
                    fleet.check_version(version)
                    total = time.perf_counter() - t0
                    parts = {name: sum(d for ep, d in calls if prefix and ep.startswith(prefix))
                             for name, prefix in FLOOR_CALLS}
                    parts["probe"] = probe
                    # the send's requests run beside the broadcast: 'other' is the rest (export, staging, gloo, write)
                    parts["other"] = total - sum(parts.values())
                    per_sync.append((total, parts))
                steady = per_sync[1:] or per_sync
                med = {k: statistics.median(p[k] for _, p in steady) for k in steady[0][1]}
                total = statistics.median(t for t, _ in steady)
                floors[mode] = statistics.median(t - p["probe"] for t, p in steady)
                table.append((mode, per_sync[0][0], total, med))
        finally:
            for m, f in originals.items():
                m.http_json = f
        c0 = cpu()
        time.sleep(5)
        idle_after = (cpu() - c0) / 5
        fleet.close_weight_group()
    lines.append(f"sync floor: tiny qwen2 ({nbytes / 1e6:.2f} MB fp32) on its own server ({args.server_args!r} "
                 f"extra args; idle it uses {idle:.2f} CPU cores, {idle_after:.2f} after the syncs); ms, median of "
                 f"{args.floor_repeats} syncs after the first, as RolloutWorker.sync_weights makes them (probe = the "
                 "heal's is_healthy; send = the update requests; other = export, staging, broadcast, disk write)")
    cols = [name for name, _ in FLOOR_CALLS] + ["other"]
    lines.append(f"{'mode':<14}{'first':>8}{'total':>8}" + "".join(f"{c:>9}" for c in cols))
    for mode, first, total, med in table:
        lines.append(f"{mode:<14}{1e3 * first:>8.1f}{1e3 * total:>8.1f}" +
                     "".join(f"{1e3 * med[c]:>9.1f}" for c in cols))
    return lines, floors


def run_sglang(args, python, hf_dir, work, cfg, buckets, views, modes, add_row, bench_generate, dw, dr,
               plat) -> None:
    import psutil

    from megappo.rollout.sglang.fleet import SGLangFleet
    from megappo.rollout.sglang.server import SGLangServer
    from megappo.trainer.checkpointing import write_actor_hf_dir

    server = SGLangServer(hf_dir, python=python, max_total_tokens=args.max_total_tokens,
                          extra_args=shlex.split(args.server_args))
    server.env["OMP_NUM_THREADS"] = str(args.threads)
    t0 = time.perf_counter()
    with server:
        up = time.perf_counter() - t0
        tree = [psutil.Process(server.proc.pid)]
        tree += tree[0].children(recursive=True)
        cpu = lambda: sum(sum(p.cpu_times()[:2]) for p in tree if p.is_running())  # noqa: E731
        c0 = cpu()
        time.sleep(5)
        print(f"SGLang server {server.url} up in {up:.0f} s ({python}, extra args {args.server_args!r}); idle, it "
              f"uses {(cpu() - c0) / 5:.2f} CPU cores", flush=True)
        fleet = SGLangFleet([server.url], timeout=1800, engine_kwargs={"api_key": server.api_key,
                                                                        "sync_timeout": 600})
        version = [0]

        def around(send):  # megappo.trainer.weight_sync.around_sync
            version[0] += 1
            fleet.pause()
            try:
                send(version[0])
            finally:
                fleet.resume()
            fleet.check_version(version[0])
            fleet.weight_version = version[0]

        sync_dir = os.path.join(work, "weight_sync")
        for mode in modes:
            if mode == "distributed":
                add_row("sglang:distributed", timed_syncs(
                    lambda: around(lambda v: fleet.update_weights(views(), version=v)), args.repeats))
            elif mode == "tensor":
                add_row("sglang:tensor", timed_syncs(
                    lambda: around(lambda v: fleet.update_weights_from_tensor(views(), version=v)), args.repeats))
            elif mode == "disk":
                write_t, load_t = [], []

                def disk_sync():
                    t = time.perf_counter()
                    write_actor_hf_dir(buckets(), cfg, hf_dir, sync_dir, plat.dtype)
                    write_t.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    around(lambda v: fleet.update_weights_from_disk(sync_dir, version=v))
                    load_t.append(time.perf_counter() - t)

                add_row("sglang:disk", timed_syncs(disk_sync, args.repeats), 1 / (1 / dw + 1 / dr))
                add_row("  disk: export+write", write_t, dw)
                add_row("  disk: server reload", load_t, dr)
        bench_generate("SGLang server", fleet)
        fleet.close_weight_group()


if __name__ == "__main__":
    main()
