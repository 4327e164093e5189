"""Result tables (paper numbers beside ours) and, later, the report. Reads eval JSON only."""

from vlbert_core.tables.build import TABLE_SPECS, build_table, load_reported, write_tables

__all__ = ["TABLE_SPECS", "build_table", "load_reported", "write_tables"]
