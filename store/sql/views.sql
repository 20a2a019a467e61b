-- lgt store views. Works from any DuckDB client started in the store directory:
--   cd runs/demo/store && duckdb -init /path/to/views.sql
-- (lgt's own tools set file_search_path to the store instead.)
CREATE OR REPLACE VIEW calls AS
SELECT * FROM read_parquet('calls/*.parquet', union_by_name = true);
