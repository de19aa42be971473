"""The Markdown tables and the PNG plots of a bench_all.py results dict."""
from __future__ import annotations

import os

LABELS = {
    "verneuil": "verneuil mount (this)",
    "s3fs": "s3fs-fuse",
    "rclone_off": "rclone, vfs cache off",
    "rclone_full": "rclone, vfs cache full",
    "restore": "verneuilctl restore + query",
    "local": "local file",
}
ORDER = ("verneuil", "s3fs", "rclone_off", "rclone_full", "restore", "local")
THIS = "#d62728"
PEER = "#7f7f7f"
BASE = "#1f77b4"


def _mib(n) -> str:
    return "–" if n is None else ("%.1f" % (n / (1 << 20)) if n >= (1 << 20) else
                                  "%.2f" % (n / (1 << 20)))


def _ms(s) -> str:
    if s is None:
        return "–"
    ms = s * 1e3
    return "%.0f" % ms if ms >= 100 else ("%.1f" % ms if ms >= 1 else "%.3f" % ms)


def _time(s) -> str:
    """Milliseconds below 10 s, seconds above, with the unit."""
    if s is None:
        return "–"
    return "%s ms" % _ms(s) if s < 10 else "%.1f s" % s


def _bytes(n) -> str:
    if n is None:
        return "–"
    if n >= (1 << 30):
        return "%.1f GiB" % (n / (1 << 30))
    if n >= (1 << 20):
        return "%.1f MiB" % (n / (1 << 20))
    return "%.0f KiB" % (n / 1024)


def _s(s) -> str:
    return "–" if s is None else ("%.1f" % s if s >= 10 else "%.2f" % s)


def _n(x) -> str:
    return "–" if x is None else "%d" % round(x)


def _get(d, *path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def bounds(r: dict) -> dict:
    """One line per figure: what limits it, from this run's own numbers."""
    out = {}
    c = r.get("ceiling", {})
    read = _get(r, "read", "systems") or {}
    v = read.get("verneuil", {})
    if c and v.get("scan"):
        rate = v["scan"]["gets"] / v["scan"]["median_s"] if v["scan"]["median_s"] else 0
        out["verneuil_scan"] = (
            "moto's per-request CPU (one GET per 64 KiB chunk): %.0f GETs/s during the scan; "
            "the store alone gave %.0f GETs/s in this run (16 threads of 64 KiB GETs, no FUSE, "
            "the ceiling phase) on this 2-core machine" % (rate, c["chunk_GETs_per_s"]))
    if c:
        out["peers_scan"] = (
            "few large range GETs: bound by moto's send path and the Python proxy "
            "(one whole-object GET: %.0f MB/s) and by each client's read-ahead"
            % c["whole_object_GET_MBps"])
        out["point"] = (
            "round trips: %.0f ms added per request; a 64 KiB ranged GET of the big object "
            "costs %.0f ms end to end" % (r["meta"]["latency_ms"], c["ranged_64k_GET_ms"]))
    s = r.get("sync")
    if s:
        out["sync"] = ("one PUT per 64 KiB chunk (%d requests) vs %d multipart PUTs of 8 MiB: "
                       "moto's per-request CPU" % (s["copier_requests"], s["plain_upload_requests"]))
    return out


def markdown(r: dict) -> str:
    m = r["meta"]
    lines = ["# Benchmark results", "",
             "- date: %s; mode: `%s`; wall time %s s" % (m["date"], m["mode"],
                                                         m.get("wall_seconds", "?")),
             "- machine: %s; Python %s, SQLite %s, moto %s" % (m["machine"], m["python"],
                                                               m["sqlite"], m["moto"]),
             "- store: %s" % m["store"],
             "- peers: %s" % ", ".join("%s" % v for v in (m.get("tools") or {}).values() if v),
             "- command: `.venv/bin/python %s`" % m["command"],
             "- load average (1 min) at start/end: %s / %s (other work on the machine shares "
             "the cores with moto, the proxy and the mounts)" % (m.get("loadavg_start"),
                                                                 m.get("loadavg_end")),
             "- each figure is the median of %d runs (point queries: %d); ratios are between "
             "figures of this run" % (m["runs"], m["point_runs"]), ""]
    if r.get("errors"):
        lines += ["**Phases that failed:** %s" % r["errors"], ""]
    b = bounds(r)

    # Readers.
    read = r.get("read")
    if read:
        lines += ["## Readers: one %.0f MiB database (%d rows), cold and warm" %
                  (read["db_bytes"] / (1 << 20), read["rows"]), "",
                  "Cold: a fresh mount with empty caches, kernel page cache dropped. Warm: the "
                  "same scan again on the same mount after dropping the page cache (only each "
                  "system's own cache helps). Hot: the same scan once more, page cache kept. "
                  "GETs and bytes are counted at the proxy.", "",
                  "| system | cold point query | GETs | bytes down | cold full scan | MB/s | GETs "
                  "| bytes down | warm full scan | GETs | hot full scan |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for sysname in ORDER:
            x = read["systems"].get(sysname)
            if not x:
                continue
            p, sc, w = x.get("point", {}), x.get("scan", {}), x.get("warm", {})
            hot = x.get("hot", {})
            kib = p.get("bytes_down")
            label = LABELS[sysname]
            if sysname == "verneuil":
                label = "**%s**" % label
            lines.append("| %s | %s | %s | %s | %s s | %s | %s | %s | %s s | %s | %s s |" % (
                label, _time(p.get("median_s")), _n(p.get("gets")), _bytes(kib),
                _s(sc.get("median_s")), sc.get("MBps", "–"), _n(sc.get("gets")),
                _bytes(sc.get("bytes_down")), _s(w.get("median_s")), _n(w.get("gets")),
                _s(hot.get("median_s"))))
        lines.append("")
        rv = read["systems"].get("verneuil", {})
        if rv.get("point") and rv["point"].get("gets_incl_prefetch") is not None:
            lines.append("GETs and bytes of a point query are counted when the answer is back; "
                         "for the verneuil mount, counting 0.5 s later (prefetches still in "
                         "flight landed) gives %s GETs, %s." % (
                             _n(rv["point"]["gets_incl_prefetch"]),
                             _bytes(rv["point"]["bytes_down_incl_prefetch"])))
            lines.append("")
        if b:
            lines += ["Bound by:", ""]
            if "point" in b:
                lines.append("- point queries: %s." % b["point"])
            if "verneuil_scan" in b:
                lines.append("- verneuil cold scan: %s." % b["verneuil_scan"])
            if "peers_scan" in b:
                lines.append("- s3fs/rclone cold scans: %s." % b["peers_scan"])
            lines.append("")

    # Readers on the nginx rig.
    rig, rread = r.get("rig"), r.get("read_rig")
    if rig and rread:
        c = rig["ceiling"]
        lines += ["## Readers on a store that is not the bottleneck (nginx, %s ms per request)"
                  % _n(rig["latency_ms"]), "",
                  "nginx serves the chunk objects and the raw file from files, moto the rest "
                  "(benchlib/nginx_rig.py). The rig's own ceiling, from curl --parallel: %s GETs/s "
                  "with 16 in flight, %s with 64 (nginx's CPU %s ms per GET; %s); one whole-object "
                  "GET %s MB/s." % (_n(c["GETs_per_s_16"]), _n(c["GETs_per_s_64"]),
                                    c["nginx_cpu_ms_per_get_64"], c["bound"], c["whole_object_GET_MBps"]), "",
                  "| system | cold point query | GETs | cold full scan | MB/s | GETs | process CPU "
                  "| CPU per GET | warm full scan | hot full scan |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for sysname in ORDER:
            x = rread["systems"].get(sysname)
            if not x:
                continue
            p, sc, w, hot = x.get("point", {}), x.get("scan", {}), x.get("warm", {}), x.get("hot", {})
            label = "**%s**" % LABELS[sysname] if sysname == "verneuil" else LABELS[sysname]
            lines.append("| %s | %s | %s | %s s | %s | %s | %s | %s | %s s | %s s |" % (
                label, _time(p.get("median_s")), _n(p.get("gets")), _s(sc.get("median_s")),
                sc.get("MBps", "–"), _n(sc.get("gets")),
                "%s s" % sc["cpu_s"] if "cpu_s" in sc else "–",
                "%s ms" % sc["cpu_ms_per_get"] if "cpu_ms_per_get" in sc else "–",
                _s(w.get("median_s")), _s(hot.get("median_s"))))
        lines.append("")
        split = _get(rread, "systems", "verneuil", "scan", "cpu_ms_per_get_by_thread")
        busy = {name: _get(rread, "systems", name, "scan", "machine_busy_cores") for name in rread["systems"]}
        busy = {name: cores for name, cores in busy.items() if cores is not None}
        if busy:
            lines += ["Cores busy during each cold scan (every process and the kernel, of %d): %s." % (
                os.cpu_count() or 0, ", ".join("%s %s" % (name, cores) for name, cores in busy.items())), ""]
        if split:
            lines += ["This mount's CPU per GET over the cold scan, by thread: trio's %s ms (FUSE requests "
                      "and replies, flights, readahead), the engines' %s ms (the chunk engine in C: requests, "
                      "decoding and verifying answers, cache writes; the store's for manifests), trio's "
                      "workers %s ms." % (
                          split["trio"], split["engine"], split["workers"]), ""]
        cp = rig.get("chunk_path")
        if cp:
            c, one, packed = cp["engine"], cp["singles"], cp["packs"]
            lines += ["The engine's side alone, without FUSE (a process of the benchmark's, %d GETs in flight, "
                      "each answer decoded, verified and written to a file): one GET per chunk object on the "
                      "mount's chunk engine in C, %s chunks/s at %s ms of CPU per chunk; the same on the "
                      "store's HTTP engine in Python, %s chunks/s at %s ms; the same %s chunks packed %d to an "
                      "object (one GET per pack, the engine in Python), %s chunks/s at %s ms per chunk." % (
                          cp["in_flight"], _n(c["chunks_per_s"]), c["cpu_ms_per_chunk"],
                          _n(one["chunks_per_s"]), one["cpu_ms_per_chunk"], _n(cp["chunks"]),
                          cp["pack_chunks"], _n(packed["chunks_per_s"]), packed["cpu_ms_per_chunk"]), ""]
        sy = rig.get("sync")
        if sy:
            lines += ["Initial sync to the rig (chunk PUTs land in nginx's files): %s %s MB/s (%s s, "
                      "%s PUTs, %s ms of its CPU per PUT) against one plain boto3 upload_file %s MB/s "
                      "(%s s, multipart to moto): ×%s the speed." % (
                          sy["flush"], sy["flush_MBps"], sy["flush_s"], _n(sy["flush_puts"]),
                          sy["flush_cpu_ms_per_put"], sy["plain_upload_MBps"], sy["plain_upload_s"],
                          sy["flush_vs_plain"]), ""]

    # System figures.
    lines += ["## The rest of the system", "", "| figure | this system | baseline, same run | this system vs baseline |",
              "|---|---:|---:|---:|"]
    w = _get(r, "writer", "sync") or {}
    for sync in ("FULL", "OFF"):
        if sync in w:
            x = w[sync]
            lines.append("| writer commit, one-row UPDATE, %.0f MB db, synchronous=%s (median of %d) "
                         "| %s ms | plain SQLite %s ms | ×%.2f the time |" % (
                             r["writer"]["db_bytes"] / 1e6, sync, x["n"],
                             "%.3f" % x["verneuil_median_ms"], "%.3f" % x["unix_median_ms"],
                             x["ratio"]))
    lag = r.get("lag")
    if lag:
        lines.append("| replication lag, %d commits at %.0f/s (commit → manifest in the store) "
                     "| median %s ms, p99 %s ms | – | – |" % (
                         lag["commits"], lag["hz"], lag["median_ms"], lag["p99_ms"]))
    s = r.get("sync")
    if s:
        lines.append("| initial sync of %.0f MiB, %d workers | copier %.1f MB/s (%s s) | boto3 "
                     "upload_file %.1f MB/s (%s s) | ×%.2f the speed |" % (
                         s["db_bytes"] / (1 << 20), s["workers"], s["copier_MBps"],
                         _s(s["copier_s"]), s["plain_upload_MBps"], _s(s["plain_upload_s"]),
                         s["copier_vs_plain"]))
        lines.append("| writer's first snapshot of that database | %.2f s (%.0f MB/s) | – | – |"
                     % (s["writer_snapshot_s"], s["writer_snapshot_MBps"]))
    f = r.get("fanout")
    if f:
        for kind in ("cold", "warm"):
            lines.append("| fan-out: one aggregate over %d replicated dbs (%.0f KiB each), %s "
                         "| Spark local[2] %s s | Python loop %s s | ×%.2f the speed |" % (
                             f["dbs"], f["db_bytes_each"] / 1024, kind,
                             _s(f["spark"][kind]["median_s"]), _s(f["python"][kind]["median_s"]),
                             f["spark_vs_python_" + kind]))
    st = r.get("storage")
    if st:
        d = st["dedup"]
        lines.append("| storage, %d near-identical %d MiB dbs | %s MiB stored | %s MiB of "
                     "databases | ×%.3f the bytes |" % (d["dbs"], d["db_mb"], _mib(d["stored_bytes"]),
                                               _mib(d["total_db_bytes"]), d["ratio"]))
        for key, what in (("sync_db", "the readers' database"), ("fanout_dbs", "the fan-out dbs")):
            if key in st:
                x = st[key]
                lines.append("| storage, %s (%s) | %s MiB stored | %s MiB | ×%.3f the bytes |" % (
                    what, x["content"], _mib(x["stored_bytes"]), _mib(x["db_bytes"]), x["ratio"]))
    c = r.get("ceiling")
    if c:
        lines.append("| store ceiling through the proxy: 64 KiB GETs, 16 threads | %.0f GETs/s "
                     "(%.1f MB/s) | one whole-object GET %.0f MB/s | – |" % (
                         c["chunk_GETs_per_s"], c["chunk_MBps"], c["whole_object_GET_MBps"]))
    lines.append("")
    if f:
        lines.append("Fan-out: Spark session start %.1f s (not counted); the schema is given "
                     "(`.schema(...)`); the same warm Spark query with the schema inferred by "
                     "the source: %s s. GETs per cold pass: Spark %s, Python %s." % (
                         f["spark_session_start_s"], f.get("spark_inferred_schema_warm_s", "?"),
                         _n(f["spark"]["cold"]["gets"]), _n(f["python"]["cold"]["gets"])))
    if "sync" in b:
        lines.append("Initial sync is bound by %s." % b["sync"])
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ plots
def _hbar(ax, names, values, colors, fmt, notes=None, log=False):
    ys = range(len(names))
    ax.barh(list(ys), values, color=colors)
    ax.set_yticks(list(ys))
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    top = max(v for v in values if v) if any(values) else 1
    ax.set_xlim(right=top * (30 if log else 1.6))
    for y, v in zip(ys, values):
        if v is None:
            continue
        text = fmt(v) + ("" if not notes or not notes[y] else "  " + notes[y])
        ax.text(v * (1.08 if log else 1) + (0 if log else top * 0.02), y, text,
                va="center", fontsize=8)
    ax.grid(axis="x", alpha=0.3)


def _save(fig, title: str, stamp: str, out_dir: str, name: str) -> str:
    """Title, stamp, lay out, write ``out_dir/name`` and close the figure."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=12)
    fig.text(0.01, 0.01, stamp, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(r: dict, out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    m = r["meta"]
    stamp = "%s · %s · %s" % (m["date"], m["machine"].split(" (")[0], m["command"])
    read = _get(r, "read", "systems")
    if read:
        systems = [s for s in ORDER if s in read]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
        size = r["read"]["db_bytes"] / (1 << 20)
        colors = [THIS if s == "verneuil" else (BASE if s == "local" else PEER) for s in systems]
        names = [LABELS[s] for s in systems]
        for ax, kind, title, unit in (
                (axes[0], "point", "cold point query (log scale)", 1e3),
                (axes[1], "scan", "cold full scan (log scale)", 1),
                (axes[2], "warm", "warm full scan, page cache dropped (log)", 1)):
            vals, notes = [], []
            for s in systems:
                x = read[s].get(kind, {})
                v = x.get("median_s")
                vals.append(None if v is None else max(v * unit, 1e-3))
                if s == "local" or x.get("gets") is None:
                    notes.append("")
                elif not x["gets"]:
                    notes.append("0 GETs")
                else:
                    notes.append("%d GETs, %s" % (x["gets"], _bytes(x["bytes_down"])))
            _hbar(ax, names, [v or 0 for v in vals], colors,
                  (lambda v: ("%.0f ms" % v if v < 10_000 else "%.0f s" % (v / 1e3))
                   if v >= 10 else "%.1f ms" % v) if kind == "point"
                  else (lambda v: "%.1f s" % v if v >= 1 else "%.2f s" % v), notes, log=True)
            ax.set_title(title, fontsize=10)
        for ax in axes[1:]:
            ax.set_yticklabels([])
        written.append(_save(fig, "Reading one %.0f MiB SQLite database from S3 (moto + %.0f ms/request), "
                             "lower is better" % (size, m["latency_ms"]), stamp, out_dir, "readers.png"))

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    axes = axes.ravel()
    w = _get(r, "writer", "sync") or {}
    ax = axes[0]
    if w:
        syncs = [k for k in ("FULL", "OFF") if k in w]
        xs = range(len(syncs))
        ax.bar([x - 0.2 for x in xs], [w[k]["unix_median_ms"] for k in syncs], 0.4,
               color=BASE, label="plain SQLite")
        ax.bar([x + 0.2 for x in xs], [w[k]["verneuil_median_ms"] for k in syncs], 0.4,
               color=THIS, label="verneuil VFS")
        for x, k in zip(xs, syncs):
            ax.text(x - 0.2, w[k]["unix_median_ms"], "%.2f ms" % w[k]["unix_median_ms"],
                    ha="center", va="bottom", fontsize=8)
            ax.text(x + 0.2, w[k]["verneuil_median_ms"], "%.2f ms (×%.2f)" % (
                w[k]["verneuil_median_ms"], w[k]["ratio"]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(["synchronous=%s" % k for k in syncs])
        ax.set_ylabel("ms per commit (median, lower is better)")
        ax.set_ylim(top=max(w[k]["verneuil_median_ms"] for k in syncs) * 1.2)
        ax.legend(fontsize=8)
    ax.set_title("writer: commit latency, one-row UPDATE", fontsize=10)

    ax = axes[1]
    lag = r.get("lag")
    if lag and lag.get("median_ms") is not None:
        ax.bar(["median", "p99"], [lag["median_ms"], lag["p99_ms"]], color=THIS)
        for i, v in enumerate([lag["median_ms"], lag["p99_ms"]]):
            ax.text(i, v, "%.0f ms" % v, ha="center", va="bottom", fontsize=9)
        ax.set_ylabel("ms")
        ax.set_ylim(top=lag["p99_ms"] * 1.18)
    ax.set_title("replication lag: commit → manifest in the store\n(%s commits at %s/s)"
                 % (lag and lag["commits"], lag and "%.0f" % lag["hz"]), fontsize=10)

    ax = axes[2]
    s = r.get("sync")
    if s:
        ax.bar(["verneuil copier\n(%d PUTs)" % s["copier_requests"],
                "boto3 upload_file\n(%d PUTs)" % s["plain_upload_requests"]],
               [s["copier_MBps"], s["plain_upload_MBps"]], color=[THIS, PEER])
        for i, v in enumerate([s["copier_MBps"], s["plain_upload_MBps"]]):
            ax.text(i, v, "%.1f MB/s" % v, ha="center", va="bottom", fontsize=9)
        ax.set_ylabel("MB/s (higher is better)")
        ax.set_ylim(top=max(s["copier_MBps"], s["plain_upload_MBps"]) * 1.18)
        ax.set_title("initial sync of %.0f MiB" % (s["db_bytes"] / (1 << 20)), fontsize=10)

    ax = axes[3]
    f = r.get("fanout")
    if f:
        kinds = ("cold", "warm")
        xs = range(2)
        py = [f["python"][k]["median_s"] for k in kinds]
        sp = [f["spark"][k]["median_s"] for k in kinds]
        ax.bar([x - 0.2 for x in xs], py, 0.4, color=BASE, label="sequential Python loop")
        ax.bar([x + 0.2 for x in xs], sp, 0.4, color=THIS, label="Spark local[2]")
        for x, a, b in zip(xs, py, sp):
            ax.text(x - 0.2, a, "%.1f s" % a, ha="center", va="bottom", fontsize=8)
            ax.text(x + 0.2, b, "%.1f s" % b, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(["cold mount", "warm (disk cache)"])
        ax.set_ylabel("s (lower is better)")
        ax.set_ylim(top=max(py + sp) * 1.25)
        ax.legend(fontsize=8)
        ax.set_title("fan-out: one aggregate over %d replicas on the mount" % f["dbs"], fontsize=10)

    ax = axes[4]
    st = r.get("storage")
    if st:
        groups = [("%d near-identical\n%d MiB dbs" % (st["dedup"]["dbs"], st["dedup"]["db_mb"]),
                   st["dedup"]["total_db_bytes"], st["dedup"]["stored_bytes"])]
        if "fanout_dbs" in st:
            groups.append(("%d fan-out dbs" % st["fanout_dbs"]["dbs"], st["fanout_dbs"]["db_bytes"],
                           st["fanout_dbs"]["stored_bytes"]))
        if "sync_db" in st:
            groups.append(("readers' db\n(random bytes)", st["sync_db"]["db_bytes"],
                           st["sync_db"]["stored_bytes"]))
        pct = [100.0 * g[2] / g[1] for g in groups]
        ax.bar(range(len(groups)), pct, 0.6, color=THIS)
        ax.axhline(100, color=PEER, linestyle="--", linewidth=1)
        ax.text(-0.45, 102, "= size of the databases", ha="left", va="bottom",
                fontsize=8, color="#555555")
        for x, (g, v) in enumerate(zip(groups, pct)):
            ax.text(x, v, "%.0f%%\n%s of %s MiB" % (v, _mib(g[2]), _mib(g[1])), ha="center",
                    va="bottom", fontsize=8)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([g[0] for g in groups], fontsize=8)
        ax.set_ylim(0, 135)
        ax.set_ylabel("bytes stored, % of database bytes")
        ax.set_title("storage: content-addressed chunks, zstd", fontsize=10)

    ax = axes[5]
    c = r.get("ceiling")
    if c and read and "verneuil" in read and read["verneuil"].get("scan"):
        v = read["verneuil"]["scan"]
        rate = v["gets"] / v["median_s"]
        ax.bar(["store alone\n(16 threads of GETs, no FUSE)", "verneuil mount, cold scan"],
               [c["chunk_GETs_per_s"], rate], color=[PEER, THIS])
        for i, val in enumerate([c["chunk_GETs_per_s"], rate]):
            ax.text(i, val, "%.0f/s" % val, ha="center", va="bottom", fontsize=9)
        ax.set_ylabel("64 KiB GETs per second")
        ax.set_ylim(top=max(c["chunk_GETs_per_s"], rate) * 1.18)
        ax.set_title("what bounds the cold scan: moto's GET rate", fontsize=10)
    written.append(_save(fig, "verneuil: writer, copier, Spark fan-out, storage", stamp, out_dir, "system.png"))
    return written
