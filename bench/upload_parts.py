"""The Uploads API against its peer, one ``POST /v1/files``, in the same run: a file of ``--mb``
megabytes sent through the openai SDK both ways to an in-process server (the embedded default:
SQLite and a local storage directory, or whatever BATCHAPI_* says, e.g. an s3:// storage URL),
and the chunked upload's rate as a fraction of the single upload's.

    .venv/bin/python bench/upload_parts.py [--mb 150] [--part-mb 64]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import uvicorn
from openai import OpenAI

from batchapi.api.limits import server_options
from batchapi.api.main import create_app
from batchapi.config import load_settings
from batchapi.db.migrate import upgrade


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=150, help="file size in MB (at most BATCHAPI_MAX_FILE_BYTES)")
    parser.add_argument("--part-mb", type=int, default=64, help="part size of the chunked upload")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = load_settings(data_dir=Path(tmp) / "data", auth_required=False)
        upgrade(settings)
        source = Path(tmp) / "input.jsonl"
        line = b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
        with source.open("wb") as out:
            for _ in range(args.mb * 1024 * 1024 // len(line)):
                out.write(line)
        size = source.stat().st_size
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                                               **server_options()))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
            started = time.perf_counter()
            single = client.files.create(file=source.open("rb"), purpose="batch")
            single_s = time.perf_counter() - started
            started = time.perf_counter()
            upload = client.uploads.upload_file_chunked(file=source, mime_type="text/jsonl", purpose="batch",
                                                        part_size=args.part_mb * 1024 * 1024)
            chunked_s = time.perf_counter() - started
            same = (hashlib.sha256(client.files.content(upload.file.id).content).digest()
                    == hashlib.sha256(source.read_bytes()).digest())
        finally:
            server.should_exit = True
            thread.join(timeout=30)
    mb = size / 1e6
    print(f"file: {mb:.1f} MB, storage {settings.resolved_storage_url.split(':')[0]}, {os.cpu_count()} CPUs")
    print(f"POST /v1/files (peer):         {single_s:6.2f} s  {mb / single_s:7.1f} MB/s  ({single.bytes} bytes)")
    print(f"uploads, {args.part_mb} MB parts:        {chunked_s:6.2f} s  {mb / chunked_s:7.1f} MB/s  "
          f"(byte-identical: {same})")
    print(f"chunked / single rate: {single_s / chunked_s:.2f}")


if __name__ == "__main__":
    main()
