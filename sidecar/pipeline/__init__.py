"""Snapshot -> storage objects -> MANIFEST. The encoders of later stages
(delta, quantize) plug in between cutting and upload."""

from sidecar.pipeline.upload import RangeDigests, upload_snapshot

__all__ = ["RangeDigests", "upload_snapshot"]
