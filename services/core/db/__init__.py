"""Core's database layer: every SQL statement and row mapping (moving here module by
module; today the dispatch path: workers, claims, reports, turns, the reaper)."""
