"""What users run and read: the click CLI, the local demo, reports and plots, the export, the namespace WAN
helpers."""
