"""paper_repro: regenerates the tables and figures of arXiv 2607.21475."""
