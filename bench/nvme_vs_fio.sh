#!/usr/bin/env bash
# memplan's NVMe path against fio on the same file and settings: sequential write and read of
# SIZE bytes, block 1 MiB, queue depth 16, O_DIRECT, with fio's io_uring and libaio engines and
# `memplan bench nvme --backend uring|aio`. fio lays the file out once (the unrecorded warm-up) and
# memplan benches that same file (--file), so both tools measure the same blocks. Per direction
# both do the same work: the whole SIZE, writes timed to the end of a final sync (fio end_fsync=1,
# memplan's fdatasync); fio runs a write job then a read job, memplan one invocation that writes
# then reads. ROUNDS rounds (default 3) alternate the tools to spread drift and noise; the table
# shows each median and the ratio memplan/fio, checked against the acceptance: io_uring >= 0.95 x
# fio io_uring, libaio >= 0.90 x fio libaio. Exit 0 when every row passes, 1 otherwise.
#
# Usage: bench/nvme_vs_fio.sh [DIR] [SIZE]
#   DIR   directory on the drive to measure (default: a scratch directory under $TMPDIR, else
#         /var/tmp, else the repository; never a tmpfs such as /dev/shm). A fresh subdirectory is
#         made inside it, holding the one bench file, and removed at exit.
#   SIZE  bytes per run, with an optional K/M/G suffix (powers of 1024; default 1G).
# Environment: MEMPLAN (the binary; default build/tools/memplan), ROUNDS (default 3).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
memplan=${MEMPLAN:-$root/build/tools/memplan}
rounds=${ROUNDS:-3}
size_arg=${2:-1G}
block=1M
depth=16

die() { echo "nvme_vs_fio: $*" >&2; exit 2; }
[ -x "$memplan" ] || die "no $memplan: build first, or set MEMPLAN"
command -v fio >/dev/null || die "fio is not installed (apt-get install fio)"
command -v python3 >/dev/null || die "python3 is needed to read fio's JSON"
[[ $rounds =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer, got '$rounds'"

fstype() { stat -f -c %T "$1" 2>/dev/null || echo unknown; }
is_memory_fs() { case "$(fstype "$1")" in tmpfs | ramfs) return 0 ;; *) return 1 ;; esac; }

if [ $# -ge 1 ] && [ -n "$1" ]; then
  [ -d "$1" ] || die "$1: not a directory"
  base=$1
else
  base=
  for candidate in "${TMPDIR:-}" /var/tmp "$root"; do
    if [ -n "$candidate" ] && [ -d "$candidate" ] && [ -w "$candidate" ] &&
      ! is_memory_fs "$candidate"; then
      base=$candidate
      break
    fi
  done
  [ -n "$base" ] || die "no writable directory on a disk found; pass DIR"
fi
is_memory_fs "$base" && die "$base is on $(fstype "$base") (memory): pass a directory on the drive"

size=$(python3 - "$size_arg" <<'EOF'
import re, sys
m = re.fullmatch(r"(\d+)([KMGT]?)(i?B)?", sys.argv[1], re.I)
if not m or (m.group(3) and not m.group(2)):
    sys.exit(f"nvme_vs_fio: bad SIZE '{sys.argv[1]}' (e.g. 1G, 512M, 1073741824)")
n = int(m.group(1)) << (10 * " KMGT".index((m.group(2) or " ").upper()))
if n == 0 or n % (1 << 20):
    sys.exit(f"nvme_vs_fio: SIZE must be a positive multiple of 1 MiB, got {n}")
print(n)
EOF
) || exit 2

work=$(mktemp -d "$base/memplan-vs-fio.XXXXXX")
file=$work/bench.dat  # the one file both tools measure
results=$work/results.txt
cleanup() { rm -rf -- "$work"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# fio: one job, one direction; prints "<bytes/s>". The file is laid out (written in full) by the
# warm-up below, and overwrite=1 makes fio write over written blocks, as memplan's bench does.
fio_run() {  # engine rw
  fio --name=memplan-vs-fio --filename="$file" --size="$size" --bs="$block" \
    --iodepth="$depth" --direct=1 --ioengine="$1" --rw="$2" --overwrite=1 --fallocate=none \
    --end_fsync="$([ "$2" = write ] && echo 1 || echo 0)" --output-format=json |
    python3 -c '
import json, sys
doc = json.load(sys.stdin)
job = doc["jobs"][0]
if job.get("error"):
    sys.exit("fio error %s" % job["error"])
rw = job[sys.argv[1]]
if rw["io_bytes"] != int(sys.argv[2]):
    sys.exit("fio %s moved %d bytes, not %s" % (sys.argv[1], rw["io_bytes"], sys.argv[2]))
print(rw["bw_bytes"])' "$2" "$size"
}

# memplan: one configuration on fio's file, write (timed to its fdatasync) then read, each of the
# whole SIZE (no time limit); prints "<write bytes/s> <read bytes/s>".
memplan_run() {  # backend
  "$memplan" bench nvme --file "$file" --size "$size" --backend "$1" --block-size "$block" \
    --queue-depth "$depth" --seconds-per-point 0 --format json |
    python3 -c '
import json, sys
doc = json.load(sys.stdin)
best = doc["best"]
backend, size = sys.argv[1], int(sys.argv[2])
if best["backend"] != backend:
    sys.exit("memplan used %s, not %s" % (best["backend"], backend))
if not best["direct"]:
    sys.exit("memplan could not use O_DIRECT here: " + doc["note"])
if best["write_bytes"] != size or best["read_bytes"] != size:
    sys.exit("memplan wrote %d and read %d bytes, not %d each"
             % (best["write_bytes"], best["read_bytes"], size))
print(best["write_bytes_per_s"], best["read_bytes_per_s"])' "$1" "$size"
}

record_fio() {  # engine
  local w r
  w=$(fio_run "$1" write)
  r=$(fio_run "$1" read)
  echo "fio $1 write $w" >>"$results"
  echo "fio $1 read $r" >>"$results"
}

record_memplan() {  # engine backend
  local wr
  wr=$(memplan_run "$2")
  echo "memplan $1 write ${wr% *}" >>"$results"
  echo "memplan $1 read ${wr#* }" >>"$results"
}

echo "nvme_vs_fio: $file ($(fstype "$work")), $size bytes, block $block, queue depth $depth," \
  "O_DIRECT, $rounds round(s)" >&2
fio_run io_uring write >/dev/null  # warm-up: lays out the file both tools use; not recorded
[ "$(stat -c %s "$file")" = "$size" ] || die "fio did not lay $file out at $size bytes"
: >"$results"
for ((round = 1; round <= rounds; round++)); do
  echo "nvme_vs_fio: round $round/$rounds" >&2
  if ((round % 2)); then
    record_fio io_uring
    record_memplan io_uring uring
    record_fio libaio
    record_memplan libaio aio
  else
    record_memplan libaio aio
    record_fio libaio
    record_memplan io_uring uring
    record_fio io_uring
  fi
done
rm -f -- "$file"

python3 - "$results" "$file" "$(fstype "$work")" "$size" "$rounds" <<'EOF'
import statistics, sys
path, file, fs, size, rounds = sys.argv[1:]
runs = {}
for line in open(path):
    tool, engine, direction, value = line.split()
    runs.setdefault((tool, engine, direction), []).append(float(value))
need = {"io_uring": 0.95, "libaio": 0.90}
print(f"memplan vs fio, same file: {file} ({fs}), {int(size) >> 20} MiB, block 1 MiB, "
      f"queue depth 16, O_DIRECT, median of {rounds} round(s)")
print(f"{'engine':<9} {'dir':<6} {'fio MB/s':>10} {'memplan MB/s':>13} {'ratio':>7} "
      f"{'needs':>6}  result")
ok = True
for engine in ("io_uring", "libaio"):
    for direction in ("write", "read"):
        fio = statistics.median(runs[("fio", engine, direction)])
        mine = statistics.median(runs[("memplan", engine, direction)])
        ratio = mine / fio if fio > 0 else 0.0
        passed = ratio >= need[engine]
        ok = ok and passed
        print(f"{engine:<9} {direction:<6} {fio / 1e6:>10.1f} {mine / 1e6:>13.1f} {ratio:>7.3f} "
              f"{need[engine]:>6.2f}  {'PASS' if passed else 'FAIL'}")
print("overall:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
EOF
