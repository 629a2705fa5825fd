"""The run directory on S3 (through s3fs): what :class:`FsspecStorage` does, plus the
conditional writes S3 offers: create only if absent (``If-None-Match: *``), replace only if
unchanged (``If-Match: <ETag>``), and aborting the multipart uploads a killed writer left."""

from __future__ import annotations

from typing import Any

from engine.checkpoint.store.fsspec_storage import FsspecStorage
from engine.checkpoint.store.storage import OBJECT_STORE

# S3's bounds on a multipart upload's parts: every part but the last at least 5 MiB; a part
# copied from an object at most 5 GiB.
_MIN_COPIED_PART = 5 * 2**20
_MAX_COPIED_PART = 5 * 2**30


class S3Storage(FsspecStorage, kind=OBJECT_STORE):
    """A :class:`Storage` on S3 (or a wrapper of an s3fs filesystem)."""

    exclusive_create = True

    def _s3(self) -> Any:
        """The s3fs filesystem (the wrapped one under engine.faults.faulty_fs)."""
        return getattr(self.fs, "inner", self.fs)

    def abort_unfinished_uploads(self, relative: str) -> int:
        s3 = self._s3()
        bucket, key, _ = s3.split_path(self.writable_path(relative))
        aborted = 0
        while True:  # each round lists what the previous one left (a listing holds 1000 at most)
            listing = s3.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/")
            for upload in listing.get("Uploads", []):
                s3.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
            if not listing.get("IsTruncated") or not listing.get("Uploads"):
                return aborted

    def version(self, relative: str) -> tuple[int, str | None]:
        s3, bucket, key = self._s3_object(relative)
        try:
            head = s3.call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return 0, None
        return int(head["ContentLength"]), str(head["ETag"])

    def replace_prefix_if_unchanged(self, relative: str, keep: int, data: bytes, version: str | None) -> bool:
        """See :meth:`Storage.replace_prefix_if_unchanged`. A small object is read and put back
        whole in one ``PutObject``; from 5 MiB the kept bytes are copied server-side into a
        multipart upload. Either way the write that makes the new object visible is conditional
        (``If-Match`` / ``If-None-Match``)."""
        s3, bucket, key = self._s3_object(relative)
        try:
            if keep >= _MIN_COPIED_PART:
                assert version is not None  # the kept bytes are in the object
                _put_in_parts(s3, bucket, key, keep, data, version)
            else:
                head = s3.cat_file(self.path(relative), start=0, end=keep) if keep else b""
                condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
                s3.call_s3("put_object", Bucket=bucket, Key=key, Body=head + data, **condition)
        except FileExistsError:  # s3fs's name for a failed If-None-Match
            return False
        except OSError as error:
            if _is_failed_precondition(error):
                return False
            raise
        finally:
            s3.invalidate_cache(self.path(relative))
        return True

    def _s3_object(self, relative: str) -> tuple[Any, str, str]:
        s3 = self._s3()
        bucket, key, _ = s3.split_path(self.writable_path(relative))
        return s3, bucket, key


def _put_in_parts(s3: Any, bucket: str, key: str, keep: int, data: bytes, version: str) -> None:
    """The kept bytes copied server-side (a part of at most 5 GiB, as S3 allows), ``data``
    uploaded as the last part; the copy and the completion are conditional on ``version``."""
    if keep > _MAX_COPIED_PART:
        raise OSError(f"s3://{bucket}/{key} is {keep} bytes long; an object beyond 5 GiB is not appended to")
    upload = s3.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    try:
        copied = s3.call_s3("upload_part_copy", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1,
                            CopySource={"Bucket": bucket, "Key": key}, CopySourceRange=f"bytes=0-{keep - 1}",
                            CopySourceIfMatch=version)
        parts = [{"PartNumber": 1, "ETag": copied["CopyPartResult"]["ETag"]}]
        if data:
            uploaded = s3.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=2, Body=data)
            parts.append({"PartNumber": 2, "ETag": uploaded["ETag"]})
        s3.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                   MultipartUpload={"Parts": parts}, IfMatch=version)
    except BaseException:
        s3.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
        raise


def _is_failed_precondition(error: OSError) -> bool:
    """Whether s3fs's error stands for S3's "412 Precondition Failed" (or "409 Conditional
    Request Conflict": a concurrent conditional write won)."""
    response = getattr(error.__cause__, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in ("PreconditionFailed", "ConditionalRequestConflict")
