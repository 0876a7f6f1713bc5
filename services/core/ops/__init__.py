"""Operations: one transaction per call, then the notifier and the metrics; each returns
a result value for the API or a loop to shape."""
