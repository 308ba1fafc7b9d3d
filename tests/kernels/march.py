"""Building the C kernels for another -march than this CPU's, to test the vector paths it may not take."""

from pathlib import Path

from batchapi.kernels.cpu import build


def build_for(march: str, needs: set[str], source: Path, tmp_path: Path, monkeypatch) -> bool:
    """Point the C builds at ``tmp_path`` with ``-march=march``; True if this CPU has the
    ``needs`` flags to run that build. Where it has not, the build must still succeed: it is done
    here, and False returned."""
    monkeypatch.setenv("BATCHAPI_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "CFLAGS", [f"-march={march}" if f == "-march=native" else f for f in build.CFLAGS])
    if needs <= set(build.cpu_flags().split()):
        return True
    target = build.library_path(build._compiler(), source)
    build._build(build._compiler(), target, source)
    assert target.stat().st_size > 0
    return False


# -march targets without AVX-512, whose loops the native build on an AVX-512 CPU never takes
PORTABLE = [("x86-64", {"sse2"}), ("haswell", {"avx2", "fma"})]


def load_portable_elementwise(march: str, needs: set[str], tmp_path: Path, monkeypatch) -> bool:
    """The elementwise library built for ``march`` and loaded in place of the native one; False
    where this CPU cannot run that build (built, not loaded)."""
    if not build_for(march, needs, build.ELEMENTWISE_SOURCE, tmp_path, monkeypatch):
        return False
    monkeypatch.setattr(build, "_state", {})
    assert build.load_elementwise() is not None
    return True
