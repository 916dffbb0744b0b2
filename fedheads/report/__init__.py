"""Reports of runs: results.json summaries and Markdown tables (results), the papers' metrics, the
shared PNG style (plotting), communication accounting, and the cross-run table (summarize)."""
