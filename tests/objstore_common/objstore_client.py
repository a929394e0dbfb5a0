"""Drives the loopback object-store servers of the tests with the official clients.

The Rust tests (tests/objstore_common/mod.rs) and the object-store benchmark put and read
objects through this script, so what a test sets up is what the reference client of each
store wrote: boto3 for S3 (moto), google-cloud-storage for GCS (gcp-storage-emulator),
azure-storage-blob for Azure Blob (azurite).

    objstore_client.py --kind s3|gcs|azure --endpoint URL COMMAND ...

Commands (bucket means container for Azure):
    mkbucket BUCKET
    put BUCKET KEY FILE [ACL]        ACL: S3 canned ACL such as public-read
    upload-dir BUCKET PREFIX DIR     every file below DIR as PREFIX + relative path
    get BUCKET KEY OUT
    download-dir BUCKET PREFIX DIR   every object below PREFIX, as DIR + key without PREFIX
    transfer-dir BUCKET PREFIX DIR   S3 only: the same through one boto3 transfer manager with
                                     its default configuration (10 concurrent requests, 8 MiB
                                     parts), which is what `aws s3 sync` does
    list BUCKET PREFIX               JSON list of {key, size, etag}
    delete BUCKET KEY
    iam-user USER                    S3 (moto) only: an IAM user allowed s3:* and an access
                                     key of it, printed as JSON {AccessKeyId, SecretAccessKey}
    require-auth                     S3 (moto) only: from now on moto authenticates and
                                     authorizes every request (its documented
                                     POST /moto-api/reset-auth with an initial no-auth count
                                     of 0)

Loopback only: the clients are built with proxies disabled, so a proxy variable in the
environment (tests of modelfs's proxy support set them) never reroutes the harness itself.
"""

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
    os.environ.pop(name, None)

# The well-known development account of Azurite (published in Azure's documentation).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def files_below(root):
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            yield os.path.relpath(path, root).replace(os.sep, "/"), path


class S3:
    def __init__(self, endpoint, part_mib=None, checksum=None, sse=None):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        # A long read timeout: moto assembles a multipart upload in Python, which takes minutes
        # for gigabytes on a busy machine, and a retried CompleteMultipartUpload fails.
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
            config=Config(
                proxies={},
                retries={"max_attempts": 2},
                read_timeout=1800,
                # "none": no checksum at all (as boto3 before 1.36 and many other clients
                # upload), so the object has its ETag only.
                request_checksum_calculation="when_required" if checksum == "none" else None,
            ),
        )
        self.extra = {}
        if checksum and checksum != "none":
            self.extra["ChecksumAlgorithm"] = checksum.upper()
        if sse:
            self.extra["ServerSideEncryption"] = sse
        self.endpoint = endpoint
        self.upload_config = TransferConfig()
        if part_mib:
            self.upload_config = TransferConfig(
                multipart_threshold=part_mib << 20, multipart_chunksize=part_mib << 20
            )

    def mkbucket(self, bucket):
        self.client.create_bucket(Bucket=bucket)

    def put(self, bucket, key, path, acl=None):
        # The transfer manager: multipart above its threshold, as `aws s3 cp` would. A canned
        # ACL (public-read) lets tests read the object with plain, unsigned HTTP.
        extra = dict(self.extra)
        if acl:
            extra["ACL"] = acl
        self.client.upload_file(
            path, bucket, key, ExtraArgs=extra or None, Config=self.upload_config
        )

    def get(self, bucket, key, out):
        self.client.download_file(bucket, key, out)

    def list(self, bucket, prefix):
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix
        ):
            for o in page.get("Contents", []):
                out.append({"key": o["Key"], "size": o["Size"], "etag": o["ETag"].strip('"')})
        return out

    def delete(self, bucket, key):
        self.client.delete_object(Bucket=bucket, Key=key)

    def iam_user(self, user):
        iam = self.session_client("iam")
        iam.create_user(UserName=user)
        iam.put_user_policy(
            UserName=user,
            PolicyName="s3-all",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName=user)["AccessKey"]
        return {"AccessKeyId": key["AccessKeyId"], "SecretAccessKey": key["SecretAccessKey"]}

    def session_client(self, service):
        import boto3
        from botocore.config import Config

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
            config=Config(proxies={}),
        )

    def require_auth(self):
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(
            self.endpoint.rstrip("/") + "/moto-api/reset-auth",
            data=b"0",
            method="POST",
            # Not a form: moto reads the raw body as the count.
            headers={"Content-Type": "application/octet-stream"},
        )
        with opener.open(req) as resp:
            return json.load(resp)

    def transfer_dir(self, bucket, prefix, root):
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        objects = self.list(bucket, prefix)
        with create_transfer_manager(self.client, TransferConfig()) as manager:
            futures = []
            for o in objects:
                out = os.path.join(root, o["key"][len(prefix):].lstrip("/"))
                os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
                futures.append(manager.download(bucket, o["key"], out))
            for f in futures:
                f.result()
        return len(objects)


class Gcs:
    def __init__(self, endpoint):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.client = storage.Client(
            project="test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": endpoint},
        )

    def mkbucket(self, bucket):
        self.client.create_bucket(bucket)

    def put(self, bucket, key, path):
        self.client.bucket(bucket).blob(key).upload_from_filename(path)

    def get(self, bucket, key, out):
        self.client.bucket(bucket).blob(key).download_to_filename(out)

    def list(self, bucket, prefix):
        return [
            {"key": b.name, "size": b.size, "etag": b.etag or b.md5_hash or ""}
            for b in self.client.list_blobs(bucket, prefix=prefix)
        ]

    def delete(self, bucket, key):
        self.client.bucket(bucket).blob(key).delete()


class Azure:
    def __init__(self, endpoint):
        from azure.storage.blob import BlobServiceClient

        conn = (
            "DefaultEndpointsProtocol=http;"
            f"AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={endpoint.rstrip('/')}/{AZURITE_ACCOUNT};"
        )
        self.client = BlobServiceClient.from_connection_string(conn)

    def mkbucket(self, bucket):
        self.client.create_container(bucket)

    def put(self, bucket, key, path):
        with open(path, "rb") as f:
            self.client.get_blob_client(bucket, key).upload_blob(f, overwrite=True)

    def put_blocks(self, bucket, key, path, block_mib):
        """Uploads in blocks of `block_mib` MiB (Put Block, then Put Block List) with the
        blob's Content-MD5 set on the commit, as azcopy --put-md5 does."""
        import base64
        import hashlib
        from azure.storage.blob import BlobBlock, ContentSettings

        data = open(path, "rb").read()
        blob = self.client.get_blob_client(bucket, key)
        step = int(block_mib) << 20
        blocks = []
        for i, at in enumerate(range(0, len(data), step)):
            block_id = base64.b64encode(f"block-{i:06d}".encode()).decode()
            blob.stage_block(block_id, data[at:at + step])
            blocks.append(BlobBlock(block_id=block_id))
        md5 = hashlib.md5(data).digest()
        blob.commit_block_list(blocks, content_settings=ContentSettings(content_md5=md5))

    def get(self, bucket, key, out):
        with open(out, "wb") as f:
            self.client.get_blob_client(bucket, key).download_blob().readinto(f)

    def list(self, bucket, prefix):
        return [
            {"key": b.name, "size": b.size, "etag": (b.etag or "").strip('"')}
            for b in self.client.get_container_client(bucket).list_blobs(name_starts_with=prefix)
        ]

    def delete(self, bucket, key):
        self.client.get_blob_client(bucket, key).delete_blob()


KINDS = {"s3": S3, "gcs": Gcs, "azure": Azure}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kind", required=True, choices=sorted(KINDS))
    p.add_argument("--endpoint", required=True)
    p.add_argument("--workers", type=int, default=8, help="parallel uploads/downloads of *-dir")
    p.add_argument("--acl", help="S3 canned ACL for put and upload-dir (public-read)")
    p.add_argument("--part-mib", type=int, help="S3 multipart part size of uploads (boto3's default: 8)")
    p.add_argument(
        "--checksum",
        help="S3 checksum algorithm of uploads (crc32, sha256, sha1), or none for no checksum "
        "(the ETag only); boto3's default (CRC32) when not given",
    )
    p.add_argument("--sse", help="S3 server-side encryption of uploads (aws:kms, AES256)")
    p.add_argument("command")
    p.add_argument("args", nargs="*")
    a = p.parse_args()
    store = S3(a.endpoint, a.part_mib, a.checksum, a.sse) if a.kind == "s3" else KINDS[a.kind](a.endpoint)
    cmd, args = a.command, a.args

    if cmd == "mkbucket":
        store.mkbucket(*args)
    elif cmd == "put":
        if a.acl:
            args = args[:3] + [a.acl]
        store.put(*args)
    elif cmd == "put-blocks":
        store.put_blocks(*args)
    elif cmd == "get":
        store.get(*args)
    elif cmd == "delete":
        store.delete(*args)
    elif cmd == "list":
        bucket, prefix = args if len(args) == 2 else (args[0], "")
        json.dump(store.list(bucket, prefix), sys.stdout)
    elif cmd == "upload-dir":
        bucket, prefix, root = args
        jobs = [(prefix + rel, path) for rel, path in files_below(root)]
        with ThreadPoolExecutor(a.workers) as pool:
            extra = [a.acl] if a.acl else []
            list(pool.map(lambda j: store.put(bucket, j[0], j[1], *extra), jobs))
        print(len(jobs))
    elif cmd == "download-dir":
        bucket, prefix, root = args
        objects = store.list(bucket, prefix)

        def fetch(o):
            out = os.path.join(root, o["key"][len(prefix):].lstrip("/"))
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            store.get(bucket, o["key"], out)

        with ThreadPoolExecutor(a.workers) as pool:
            list(pool.map(fetch, objects))
        print(len(objects))
    elif cmd == "iam-user":
        json.dump(store.iam_user(*args), sys.stdout)
    elif cmd == "require-auth":
        json.dump(store.require_auth(), sys.stdout)
    elif cmd == "transfer-dir":
        print(store.transfer_dir(*args))
    else:
        p.error(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
