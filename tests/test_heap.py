"""freeze_startup_heap: what is alive at the call leaves the collector's passes; what comes later does not."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
import weakref
from rtp.heap import freeze_startup_heap

class Node:
    pass

before = [Node() for _ in range(1000)]
garbage = Node(); garbage.self = garbage  # a cycle nothing else refers to
gone = weakref.ref(garbage)
del garbage
freeze_startup_heap("test")
after = [Node() for _ in range(1000)]
tracked = {id(o) for o in gc.get_objects()}
assert gc.get_freeze_count() > 0
assert not any(id(o) in tracked for o in before), "start-up objects still walked by the collector"
assert all(id(o) in tracked for o in after), "objects made later must still be collected"
assert gone() is None, "garbage frozen with the heap (no collection first)"
print("ok")
"""


def test_the_startup_heap_is_frozen_and_later_objects_are_not():
    # In a process of its own: freezing the test runner's heap would outlive the test.
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
