"""Where an image folder or an output prefix lives, and how to reach it: plain settings.

The ranks, the data path and the results get these, never a Prefect block (a block
belongs to the flow's process and its API): the flow turns a saved `DataLocation` block
into one with `Location.plain`. The secrets stay SecretStr: masked in reprs and logs,
plain text only inside `storage_options()`, on the process that opens the connection.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, Field, SecretStr

# A Location or a subclass of it (a DataLocation block): what with_url gives back.
LocationT = TypeVar("LocationT", bound="Location")


class Location(BaseModel):
    """An fsspec URL and the settings to open it (S3 endpoint, region, credentials)."""

    url: str = Field(
        default="", description="s3://bucket/prefix, file:///path or a local path."
    )
    endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (MinIO, Ceph, moto); empty for AWS."
    )
    region_name: str | None = Field(default=None, description="AWS region, e.g. us-east-1.")
    anonymous: bool = Field(default=False, description="Read a public bucket without credentials.")
    aws_access_key_id: str | None = Field(
        default=None, description="Empty: boto's default chain (env, ~/.aws, instance role)."
    )
    aws_secret_access_key: SecretStr | None = None
    aws_session_token: SecretStr | None = None
    max_attempts: int | None = Field(
        default=None,
        ge=1,
        le=20,
        description="Attempts per S3 request, the first included (botocore's "
        "retries.total_max_attempts); empty keeps botocore's default. Lower it to fail faster.",
    )

    def with_url(self: LocationT, url: str | None) -> LocationT:
        """This location's connection settings pointed at another url (when one is given)."""
        return self.model_copy(update={"url": url}) if url else self

    def storage_options(self) -> dict[str, Any]:
        """fsspec keyword arguments for `url`; holds the plain secret, so never log it."""
        if not self.url.startswith(("s3://", "s3a://")):
            return {}
        options: dict[str, Any] = {"anon": self.anonymous}
        if self.endpoint_url:
            options["endpoint_url"] = self.endpoint_url
        if self.region_name:
            options["client_kwargs"] = {"region_name": self.region_name}
        if self.max_attempts:
            options["config_kwargs"] = {"retries": {"total_max_attempts": self.max_attempts}}
        if self.aws_access_key_id and not self.anonymous:
            options["key"] = self.aws_access_key_id
            if self.aws_secret_access_key:
                options["secret"] = self.aws_secret_access_key.get_secret_value()
            if self.aws_session_token:
                options["token"] = self.aws_session_token.get_secret_value()
        return options

    def plain(self) -> Location:
        """These settings alone, as a `Location`: what a subclass (a Prefect block) adds stays behind."""
        return Location.model_validate(self.model_dump(include=set(Location.model_fields)))
