# CPU image (default): the native engine with the bundled demo pair.
FROM python:3.11-slim AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY dspark_server ./dspark_server
COPY profiles ./profiles
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu '.[cpu]' \
    && useradd --create-home --uid 10001 dspark
USER dspark
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status == 200 else 1)"
CMD ["dspark", "serve", "--host", "0.0.0.0", "--port", "8000"]
