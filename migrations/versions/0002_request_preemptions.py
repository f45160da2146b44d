"""requests.preemptions: how often decode instances preempted a request for KV pages

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25 09:00:00

Existing rows get 0 (no request was preempted before the paged KV pool existed).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "requests",
        sa.Column("preemptions", sa.Integer(), server_default="0", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("requests", "preemptions")
