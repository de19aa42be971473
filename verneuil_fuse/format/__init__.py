"""The wire format (docs/FORMAT.md): UMASH, blob names, manifests and chunks.

The packed layout (`packs`: many chunk blobs per object, read by range) is
this project's addition; `chunk_source` tells any reader where a chunk is in
either layout.  Everything here is pure computation on bytes (no I/O but
/etc/hostname):
the store, copier, reader and CLI all go through this package to agree with
Verneuil on every byte.
"""
from verneuil_fuse.format.manifest import (CHUNK_ZSTD_LEVEL, DEFAULT_MAX_DB_SIZE, GENERATED_BY,
                                           MANIFEST_ZSTD_LEVEL, MAX_CHUNK_BLOB_BYTES, MAX_MANIFEST_BYTES,
                                           MAX_REPLICATED_DB_SIZE, ZSTD_MAGIC, ChunkError, ChunkList,
                                           Manifest, ManifestError, base_chunk_blob_limit, base_chunk_limit,
                                           chunk_count, chunk_mismatch, compress_chunk, compress_manifest,
                                           contents_fprint_of, decode_and_validate, decode_base_chunk,
                                           decode_chunk, encode_manifest, format_size, header_fprint_of,
                                           manifest_blob_limit, raw_manifest, same_manifest, snapshot_of,
                                           stored_fields, words_of, zstd_frame_bound)
from verneuil_fuse.format.packs import (MAX_PACK_BYTES, MAX_RUN_BYTES, PACK_KEY_PREFIX, ChunkSource,
                                        PackedLayout, Run, chunk_runs, chunk_source, chunk_sources, pack_key,
                                        parse_pack_key, space_prefix, stored_objects, strip_layout, with_layout)
from verneuil_fuse.format.names import (CHUNK_SIZE, ZERO_CHUNK_FPRINT, ZERO_CHUNK_NAME, BadName, ManifestName,
                                        chunk_fingerprint, local_hostname, manifest_name,
                                        parse_chunk_name, parse_manifest_name, percent_encode)
from verneuil_fuse.format.umash import (CHUNK_KEY, DIRECTORY_KEY, HEADER_KEY, HOSTNAME_KEY, KEYS,
                                        MANGLING_KEY, PATH_KEY, Fprint, active_impl, derived_params,
                                        fingerprint, hash64, select_impl)

__all__ = [name for name in dir() if not name.startswith("_")]
