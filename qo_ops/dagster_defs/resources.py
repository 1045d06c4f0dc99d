"""Resources: the qo-ops database (the same resolution as the CLI: a URL, or the embedded
server)."""

from __future__ import annotations

import dagster as dg
from sqlalchemy.engine import Engine

from qo_ops.config import HOME_ENV, Settings, load_settings
from qo_ops.db.engine import get_engine, resolve_target


class QoOpsDatabase(dg.ConfigurableResource["QoOpsDatabase"]):
    """The PostgreSQL database the jobs act on.

    ``url`` comes from ``QO_OPS_DATABASE_URL`` (through ``EnvVar`` in the definitions);
    left empty, the embedded server under ``QO_OPS_HOME`` is used.
    """

    url: str | None = None
    home: str | None = None

    def engine(self) -> Engine:
        """A checked engine for this database."""
        base = load_settings()
        settings = Settings(
            home=base.home if not self.home else load_settings({HOME_ENV: self.home}).home,
            database_url=self.url or base.database_url,
        )
        return get_engine(resolve_target(settings))
