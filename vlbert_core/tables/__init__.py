"""Result tables: the paper's Tables 1–4 with our numbers beside the reported ones, and the paired
tests against setting `none`. Reads eval JSONs and scored predictions files only."""

from vlbert_core.tables.build import build_table, load_reported, table_header, table_specs, write_tables

__all__ = ["build_table", "load_reported", "table_header", "table_specs", "write_tables"]
