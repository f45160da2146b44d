"""requests.tenant: whose request it is (tenants share no cached KV blocks)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-27 00:40:00

Existing rows keep NULL: they were recorded before requests had tenants (`db rebuild`
refolds them from their events, where a submission without a tenant is the default one's).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("tenant", sa.String(length=64), nullable=True))
    op.create_index("ix_requests_tenant", "requests", ["tenant"])


def downgrade() -> None:
    op.drop_index("ix_requests_tenant", table_name="requests")
    op.drop_column("requests", "tenant")
