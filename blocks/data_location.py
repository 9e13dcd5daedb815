"""Where an image folder (or an output prefix) lives, with the credentials to reach it.

Save one per bucket and endpoint, then name it in the flow's parameters:

    DataLocation(
        url="s3://my-bucket/flowers",
        region_name="eu-west-1",
        aws_access_key_id="AKIA...",
        aws_secret_access_key="...",
    ).save("flowers")

The secret is a SecretStr: it is masked in the UI, in logs and in reprs, and only turned
into plain text inside `storage_options()`, on the process that opens the connection.
"""

from __future__ import annotations

from prefect.blocks.core import Block

from prefect_ddp.tasks.location import Location


class DataLocation(Block, Location):
    """An fsspec URL and the settings to open it (S3 endpoint, region, credentials)."""

    _block_type_name = "Data Location"
    _block_type_slug = "data-location"
    _description = "An S3 prefix or local folder, with endpoint, region and credentials."
    # The fields and storage_options() are Location's (prefect_ddp.tasks.location): the flow
    # hands the ranks `block.plain()`, never the block.
