"""kernels/cpu/memory.py: the packed weights' and the KV pool's memory, on 2 MiB pages where the OS
gives them."""

import mmap
from pathlib import Path

import torch

from batchapi.kernels.cpu import memory


def thp_mode() -> str:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/enabled, or "" without THP."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeroed_memory_is_zero_starts_on_a_huge_page_and_gets_huge_pages_where_the_os_gives_them():
    t = memory.zeroed((3 << 20,), torch.uint8)  # 3 MiB
    assert t.data_ptr() % memory.HUGE_PAGE == 0 and not t.any()
    t.fill_(7)  # faulted in
    assert int(t.sum()) == 7 * (3 << 20)
    if thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        assert huge_kib(t.data_ptr()) >= 2048  # the first 2 MiB at least: one huge page
    else:  # no THP here: the same memory on small pages
        assert huge_kib(t.data_ptr()) == 0


def test_an_arenas_tensors_are_copies_on_cache_lines_sharing_a_region_and_a_big_one_has_its_own():
    arena = memory.Arena()
    sources = [torch.randn(rows, 96).bfloat16() for rows in (1, 7, 160)] + [torch.arange(5, dtype=torch.int32)]
    copies = [arena.copy(s) for s in sources]
    kept = [s.clone() for s in sources]
    for source, copy in zip(sources, copies, strict=True):
        assert copy.dtype == source.dtype and copy.shape == source.shape and torch.equal(copy, source)
        assert copy.data_ptr() % memory.Arena.ALIGN == 0 and copy.data_ptr() != source.data_ptr()
    first = copies[0].data_ptr()
    assert first % memory.HUGE_PAGE == 0  # a fresh region's start
    assert all(0 < c.data_ptr() - first < memory.Arena.CHUNK for c in copies[1:])  # one region, in order
    ends = [c.data_ptr() + c.nbytes for c in copies]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends, copies[1:], strict=False))  # no overlap
    big = arena.copy(torch.ones(memory.Arena.CHUNK + 1, dtype=torch.uint8))
    assert big.data_ptr() % memory.HUGE_PAGE == 0 and int(big.sum()) == memory.Arena.CHUNK + 1
    del sources, source
    after = arena.copy(torch.full((3,), 2.0))
    assert after.data_ptr() > copies[-1].data_ptr()  # the big one took none of the shared region
    assert after.tolist() == [2.0, 2.0, 2.0]
    assert all(torch.equal(c, k) for c, k in zip(copies, kept, strict=True))  # nothing wrote over them
