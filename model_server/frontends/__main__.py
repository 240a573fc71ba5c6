from model_server.frontends.frontend import main

raise SystemExit(main())
