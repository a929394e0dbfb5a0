"""A "pod" reading a model through a bind mount of its path, as an inference container does.

Run inside a private mount namespace after the bind (see tests/takeover.rs). It loops fresh
opens, full reads and sha256 checks of every file, and holds a few files open and reads them
throughout; every operation is timed. Progress goes to a JSON file after every pass; it stops
when the stop file appears.

usage: pod_reader.py DIR EXPECTED_JSON PROGRESS_FILE STOP_FILE [ROUND_FILE]

With ROUND_FILE, each operation's time also counts towards the longest stall of the round
named in that file (read once per pass): a test names a round per restart.
"""

import errno
import hashlib
import json
import os
import sys
import time

root, expected_path, progress_path, stop_path = sys.argv[1:5]
round_path = sys.argv[5] if len(sys.argv) > 5 else None
current_round = "0"
with open(expected_path) as f:
    expected = json.load(f)  # relative path -> sha256

stats = {
    "passes": 0,
    "opens": 0,
    "failed_opens": 0,
    "failed_reads": 0,
    "wrong": 0,
    "held_reads": 0,
    "inode_changes": 0,
    "max_stall_ms": 0.0,
    "round_max_ms": {},
    "errors": {},
}


def note_error(kind, e):
    stats[kind] += 1
    name = errno.errorcode.get(e.errno, str(e.errno))
    stats["errors"][name] = stats["errors"].get(name, 0) + 1


def timed(fn):
    t = time.monotonic()
    try:
        return fn()
    finally:
        ms = (time.monotonic() - t) * 1000.0
        if ms > stats["max_stall_ms"]:
            stats["max_stall_ms"] = ms
        rounds = stats["round_max_ms"]
        if ms > rounds.get(current_round, 0.0):
            rounds[current_round] = ms


rels = sorted(expected)
inodes = {rel: os.stat(os.path.join(root, rel)).st_ino for rel in rels}
content = {}
for rel in rels:
    with open(os.path.join(root, rel), "rb") as f:
        content[rel] = f.read()
    assert hashlib.sha256(content[rel]).hexdigest() == expected[rel], rel
# Held open for the whole run, read at moving offsets.
held = [(rel, os.open(os.path.join(root, rel), os.O_RDONLY)) for rel in rels[:3]]


def write_progress():
    tmp = progress_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(stats, f)
    os.replace(tmp, progress_path)


write_progress()
offset = 0
while not os.path.exists(stop_path):
    if round_path:
        try:
            with open(round_path) as f:
                current_round = f.read().strip() or current_round
        except OSError:
            pass
    for rel in rels:
        path = os.path.join(root, rel)
        stats["opens"] += 1
        try:
            fd = timed(lambda: os.open(path, os.O_RDONLY))
        except OSError as e:
            note_error("failed_opens", e)
            continue
        try:
            chunks = []
            while True:
                b = timed(lambda: os.read(fd, 1 << 20))
                if not b:
                    break
                chunks.append(b)
            if hashlib.sha256(b"".join(chunks)).hexdigest() != expected[rel]:
                stats["wrong"] += 1
            if timed(lambda: os.fstat(fd)).st_ino != inodes[rel]:
                stats["inode_changes"] += 1
        except OSError as e:
            note_error("failed_reads", e)
        finally:
            os.close(fd)
    for rel, fd in held:
        data = content[rel]
        if not data:
            continue
        at = offset % len(data)
        try:
            got = timed(lambda: os.pread(fd, 4096, at))
            stats["held_reads"] += 1
            if got != data[at : at + 4096]:
                stats["wrong"] += 1
        except OSError as e:
            note_error("failed_reads", e)
    offset += 7919
    stats["passes"] += 1
    write_progress()
write_progress()
