from services.core.worker.agent import main

main()
