from services.worker.agent import main

main()
