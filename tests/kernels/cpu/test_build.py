"""Building the C libraries (kernels.cpu.build): cached per source and CPU, and a failure logged, never raised."""

from batchapi.kernels.cpu import build


def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHAPI_NATIVE_DIR", str(tmp_path))
    lib = build._load()
    assert lib is not None
    built = list(tmp_path.glob("paged_decode-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert build._load() is not None
    assert built[0].stat().st_mtime_ns == mtime, "a second load rebuilt the library"
    assert [p.name for p in tmp_path.iterdir()] == [built[0].name], "a temporary file was left behind"
    assert built[0].stat().st_mode & 0o044 == 0o044, "others sharing the directory could not load it"


def test_no_home_directory_means_the_twin_not_a_crash(monkeypatch, caplog):
    monkeypatch.delenv("BATCHAPI_NATIVE_DIR", raising=False)
    monkeypatch.setattr(build.Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(
        RuntimeError("Could not determine home directory"))))
    assert build._load() is None
    assert "Could not determine home directory" in caplog.text


def test_a_broken_compiler_output_is_reported_not_raised(tmp_path, monkeypatch, caplog):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: error: unsupported option' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("BATCHAPI_NATIVE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    assert build._load() is None
    assert "unsupported option" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))


def test_build_is_cached_apart_from_the_decode_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHAPI_NATIVE_DIR", str(tmp_path))
    assert build._load_elementwise() is not None
    built = [p.name for p in tmp_path.iterdir()]
    assert len(built) == 1 and built[0].startswith("elementwise-") and built[0].endswith(".so")
    mtime = (tmp_path / built[0]).stat().st_mtime_ns
    assert build._load_elementwise() is not None
    assert (tmp_path / built[0]).stat().st_mtime_ns == mtime, "a second load rebuilt the library"
