"""Result tables: the paper's Tables 1–4 with our numbers beside the reported ones. Reads eval JSON only."""

from vlbert_core.tables.build import TABLE_SPECS, build_table, load_reported, table_header, write_tables

__all__ = ["TABLE_SPECS", "build_table", "load_reported", "table_header", "write_tables"]
