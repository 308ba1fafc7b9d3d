"""Run-to-run diff of two ended batches (an extension, docs/API_EXTENSIONS.md): which requests'
outputs changed, by ``custom_id``, and whether a change broke reproducibility. ``outcomes`` reads
one result line, ``runs`` reads a batch's files, ``compare`` makes the diff."""
