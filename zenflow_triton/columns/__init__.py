"""The column split of each matrix param: its ``[rows, cols]`` view (``layout``), the column
rule (``selection``) and the migration of columns that change owner (``migration``)."""
