"""The sweep's plan: a sweep file expanded into its trials, and their forecast (`--dry-run`)."""
