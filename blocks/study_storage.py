"""Where a sweep keeps its Optuna study when that is a database server, with its password.

A database URL carries its password (`postgresql://user:PASSWORD@host/db`); as a sweep
parameter it would be shown in the UI, stored with every flow run and logged. Save it in a
block instead, where it is a SecretStr, and name the block in the sweep's settings:

    StudyStorage(url="postgresql://optuna:...@db.internal:5432/studies").save("studies")
    # then: hyperparameter-sweep with settings.storage_block="studies"
"""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr


class StudyStorage(Block):
    """An Optuna storage URL (SQLAlchemy form), kept secret because it holds the password."""

    _block_type_name = "Study Storage"
    _block_type_slug = "study-storage"
    _description = "The database a hyperparameter sweep keeps its Optuna study in, with its password."

    url: SecretStr = Field(
        description="SQLAlchemy URL of the database, password included: postgresql://USER:PASSWORD@HOST:5432/DB "
        "or mysql+pymysql://USER:PASSWORD@HOST/DB."
    )
