"""Operations: the server process, metrics, logs, policy-file reloads, the demo."""
