from control_plane.app.cli import main

# Guarded: the OTLP decoder processes (telemetry.decoder_processes) are spawned, and a spawned
# child imports the parent's main module again.
if __name__ == "__main__":
    raise SystemExit(main())
